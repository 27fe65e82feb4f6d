-- library_schema.sql
-- Schema and example queries for a small lending library (books, members,
-- loans and reservations). Written for PostgreSQL 14+, but apart from the
-- partial indexes and the generated column it is close to standard SQL.

BEGIN;

CREATE TABLE branch (
    branch_id     SERIAL PRIMARY KEY,
    name          TEXT NOT NULL UNIQUE,
    address       TEXT NOT NULL,
    opened_on     DATE
);

CREATE TABLE author (
    author_id     SERIAL PRIMARY KEY,
    full_name     TEXT NOT NULL,
    born_year     SMALLINT CHECK (born_year BETWEEN 1000 AND 2100)
);

CREATE TABLE title (
    title_id      SERIAL PRIMARY KEY,
    isbn13        CHAR(13) UNIQUE,
    name          TEXT NOT NULL,
    published     SMALLINT,
    subject       TEXT NOT NULL DEFAULT 'general',
    pages         INTEGER CHECK (pages > 0)
);

-- A title can have several authors and an author several titles.
CREATE TABLE title_author (
    title_id      INTEGER NOT NULL REFERENCES title ON DELETE CASCADE,
    author_id     INTEGER NOT NULL REFERENCES author ON DELETE RESTRICT,
    position      SMALLINT NOT NULL DEFAULT 1,
    PRIMARY KEY (title_id, author_id)
);

-- A physical copy sitting on a shelf in one branch.
CREATE TABLE copy (
    copy_id       SERIAL PRIMARY KEY,
    title_id      INTEGER NOT NULL REFERENCES title,
    branch_id     INTEGER NOT NULL REFERENCES branch,
    barcode       TEXT NOT NULL UNIQUE,
    acquired_on   DATE NOT NULL DEFAULT CURRENT_DATE,
    withdrawn_on  DATE,
    condition     TEXT NOT NULL DEFAULT 'good'
                  CHECK (condition IN ('new', 'good', 'worn', 'damaged'))
);

CREATE TABLE member (
    member_id     SERIAL PRIMARY KEY,
    card_number   TEXT NOT NULL UNIQUE,
    full_name     TEXT NOT NULL,
    email         TEXT,
    home_branch   INTEGER REFERENCES branch,
    joined_on     DATE NOT NULL DEFAULT CURRENT_DATE,
    max_loans     SMALLINT NOT NULL DEFAULT 8
);

CREATE TABLE loan (
    loan_id       BIGSERIAL PRIMARY KEY,
    copy_id       INTEGER NOT NULL REFERENCES copy,
    member_id     INTEGER NOT NULL REFERENCES member,
    loaned_at     TIMESTAMPTZ NOT NULL DEFAULT now(),
    due_on        DATE NOT NULL,
    returned_at   TIMESTAMPTZ,
    renewals      SMALLINT NOT NULL DEFAULT 0 CHECK (renewals BETWEEN 0 AND 3),
    is_open       BOOLEAN GENERATED ALWAYS AS (returned_at IS NULL) STORED
);

-- Only one open loan per copy at a time.
CREATE UNIQUE INDEX loan_one_open_per_copy ON loan (copy_id) WHERE returned_at IS NULL;
CREATE INDEX loan_member_open ON loan (member_id) WHERE returned_at IS NULL;
CREATE INDEX loan_due ON loan (due_on) WHERE returned_at IS NULL;

CREATE TABLE reservation (
    reservation_id BIGSERIAL PRIMARY KEY,
    title_id       INTEGER NOT NULL REFERENCES title,
    member_id      INTEGER NOT NULL REFERENCES member,
    pickup_branch  INTEGER NOT NULL REFERENCES branch,
    placed_at      TIMESTAMPTZ NOT NULL DEFAULT now(),
    fulfilled_at   TIMESTAMPTZ,
    cancelled_at   TIMESTAMPTZ
);

COMMIT;

-- ---------------------------------------------------------------------------
-- Everyday queries
-- ---------------------------------------------------------------------------

-- 1. Overdue loans with the member's contact details, most overdue first.
SELECT m.card_number,
       m.full_name,
       m.email,
       t.name                         AS title,
       c.barcode,
       l.due_on,
       CURRENT_DATE - l.due_on        AS days_overdue
FROM loan l
JOIN copy   c ON c.copy_id   = l.copy_id
JOIN title  t ON t.title_id  = c.title_id
JOIN member m ON m.member_id = l.member_id
WHERE l.returned_at IS NULL
  AND l.due_on < CURRENT_DATE
ORDER BY days_overdue DESC, m.full_name;

-- 2. Copies of a title available right now, per branch.
SELECT b.name AS branch, count(*) AS available
FROM copy c
JOIN branch b ON b.branch_id = c.branch_id
WHERE c.title_id = $1
  AND c.withdrawn_on IS NULL
  AND NOT EXISTS (
        SELECT 1 FROM loan l
        WHERE l.copy_id = c.copy_id AND l.returned_at IS NULL)
GROUP BY b.name
ORDER BY available DESC;

-- 3. The twenty most borrowed titles over the last 90 days.
SELECT t.name,
       string_agg(a.full_name, ', ' ORDER BY ta.position) AS authors,
       count(DISTINCT l.loan_id)                           AS loans
FROM loan l
JOIN copy c          ON c.copy_id   = l.copy_id
JOIN title t         ON t.title_id  = c.title_id
LEFT JOIN title_author ta ON ta.title_id = t.title_id
LEFT JOIN author a   ON a.author_id = ta.author_id
WHERE l.loaned_at >= now() - INTERVAL '90 days'
GROUP BY t.title_id, t.name
ORDER BY loans DESC
LIMIT 20;

-- 4. Members who are at their loan limit (they cannot borrow more).
SELECT m.member_id, m.full_name, count(*) AS open_loans, m.max_loans
FROM member m
JOIN loan l ON l.member_id = m.member_id AND l.returned_at IS NULL
GROUP BY m.member_id
HAVING count(*) >= m.max_loans;

-- 5. Monthly loan counts per branch for a simple trend chart.
SELECT date_trunc('month', l.loaned_at)::date AS month,
       b.name                                  AS branch,
       count(*)                                AS loans
FROM loan l
JOIN copy c   ON c.copy_id = l.copy_id
JOIN branch b ON b.branch_id = c.branch_id
WHERE l.loaned_at >= date_trunc('year', now()) - INTERVAL '1 year'
GROUP BY 1, 2
ORDER BY 1, 2;

-- 6. Renew a loan if it has no waiting reservations and renewals remain.
UPDATE loan l
SET due_on   = l.due_on + 21,
    renewals = l.renewals + 1
FROM copy c
WHERE l.loan_id = $1
  AND c.copy_id = l.copy_id
  AND l.returned_at IS NULL
  AND l.renewals < 3
  AND NOT EXISTS (
        SELECT 1 FROM reservation r
        WHERE r.title_id = c.title_id
          AND r.fulfilled_at IS NULL
          AND r.cancelled_at IS NULL)
RETURNING l.loan_id, l.due_on, l.renewals;

-- 7. Queue position of each open reservation for a title.
SELECT r.reservation_id,
       m.full_name,
       r.placed_at,
       row_number() OVER (PARTITION BY r.title_id ORDER BY r.placed_at) AS position
FROM reservation r
JOIN member m ON m.member_id = r.member_id
WHERE r.fulfilled_at IS NULL AND r.cancelled_at IS NULL
ORDER BY r.title_id, position;
