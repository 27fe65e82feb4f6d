// notes_server.js
//
// A deliberately small JSON API for personal notes, using only Node's
// built-in http module. It keeps notes in memory and is meant for demos and
// tests, not production: there is no authentication and nothing is persisted.
//
// Routes:
//   GET    /health              -> { status: "ok", notes: <count> }
//   GET    /notes?tag=work      -> list notes, optionally filtered by tag
//   POST   /notes               -> create a note from { title, body, tags }
//   GET    /notes/:id           -> fetch one note
//   PATCH  /notes/:id           -> update title, body or tags
//   DELETE /notes/:id           -> remove a note

'use strict';

const http = require('node:http');
const { randomUUID } = require('node:crypto');

const MAX_BODY_BYTES = 64 * 1024;
const notes = new Map();

class HttpError extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;
  }
}

/** Read the request body and parse it as JSON, with a size limit. */
function readJson(req) {
  return new Promise((resolve, reject) => {
    let size = 0;
    const chunks = [];
    req.on('data', (chunk) => {
      size += chunk.length;
      if (size > MAX_BODY_BYTES) {
        reject(new HttpError(413, 'request body too large'));
        req.destroy();
        return;
      }
      chunks.push(chunk);
    });
    req.on('end', () => {
      if (chunks.length === 0) return resolve({});
      try {
        resolve(JSON.parse(Buffer.concat(chunks).toString('utf8')));
      } catch {
        reject(new HttpError(400, 'body is not valid JSON'));
      }
    });
    req.on('error', reject);
  });
}

function send(res, status, payload) {
  const body = payload === undefined ? '' : JSON.stringify(payload);
  res.writeHead(status, {
    'Content-Type': 'application/json; charset=utf-8',
    'Content-Length': Buffer.byteLength(body),
    'Cache-Control': 'no-store',
  });
  res.end(body);
}

/** Validate user input for a note. `partial` allows missing fields (PATCH). */
function validateNote(input, { partial = false } = {}) {
  const out = {};
  if (input.title !== undefined || !partial) {
    if (typeof input.title !== 'string' || input.title.trim() === '') {
      throw new HttpError(422, 'title must be a non-empty string');
    }
    if (input.title.length > 200) {
      throw new HttpError(422, 'title must be at most 200 characters');
    }
    out.title = input.title.trim();
  }
  if (input.body !== undefined) {
    if (typeof input.body !== 'string') throw new HttpError(422, 'body must be a string');
    out.body = input.body;
  } else if (!partial) {
    out.body = '';
  }
  if (input.tags !== undefined) {
    if (!Array.isArray(input.tags) || !input.tags.every((t) => typeof t === 'string')) {
      throw new HttpError(422, 'tags must be an array of strings');
    }
    out.tags = [...new Set(input.tags.map((t) => t.trim().toLowerCase()).filter(Boolean))];
  } else if (!partial) {
    out.tags = [];
  }
  return out;
}

function getNote(id) {
  const note = notes.get(id);
  if (!note) throw new HttpError(404, `note ${id} not found`);
  return note;
}

async function route(req, res) {
  const url = new URL(req.url, 'http://localhost');
  const parts = url.pathname.split('/').filter(Boolean);

  if (req.method === 'GET' && url.pathname === '/health') {
    return send(res, 200, { status: 'ok', notes: notes.size });
  }

  if (parts[0] !== 'notes' || parts.length > 2) {
    throw new HttpError(404, 'no such route');
  }

  if (parts.length === 1) {
    if (req.method === 'GET') {
      const tag = url.searchParams.get('tag');
      let list = [...notes.values()];
      if (tag) list = list.filter((n) => n.tags.includes(tag.toLowerCase()));
      list.sort((a, b) => b.updatedAt.localeCompare(a.updatedAt));
      return send(res, 200, { items: list, count: list.length });
    }
    if (req.method === 'POST') {
      const fields = validateNote(await readJson(req));
      const now = new Date().toISOString();
      const note = { id: randomUUID(), ...fields, createdAt: now, updatedAt: now };
      notes.set(note.id, note);
      res.setHeader('Location', `/notes/${note.id}`);
      return send(res, 201, note);
    }
    throw new HttpError(405, 'method not allowed');
  }

  const id = parts[1];
  switch (req.method) {
    case 'GET':
      return send(res, 200, getNote(id));
    case 'PATCH': {
      const note = getNote(id);
      const fields = validateNote(await readJson(req), { partial: true });
      Object.assign(note, fields, { updatedAt: new Date().toISOString() });
      return send(res, 200, note);
    }
    case 'DELETE':
      getNote(id);
      notes.delete(id);
      return send(res, 204);
    default:
      throw new HttpError(405, 'method not allowed');
  }
}

const server = http.createServer(async (req, res) => {
  const started = process.hrtime.bigint();
  try {
    await route(req, res);
  } catch (err) {
    const status = err instanceof HttpError ? err.status : 500;
    if (status === 500) console.error(err);
    send(res, status, { error: status === 500 ? 'internal error' : err.message });
  } finally {
    const ms = Number(process.hrtime.bigint() - started) / 1e6;
    console.log(`${req.method} ${req.url} ${res.statusCode} ${ms.toFixed(1)}ms`);
  }
});

if (require.main === module) {
  const port = Number(process.env.PORT || 3000);
  server.listen(port, () => console.log(`notes API listening on :${port}`));
}

module.exports = { server, validateNote, HttpError };
