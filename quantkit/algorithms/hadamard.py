"""Hadamard matrices and the orthogonal rotations built from them. Pure tensor math.

A Hadamard matrix H of order n has entries +-1 and H H^T = n I, so H / sqrt(n) is orthogonal. Rotating a
vector by it spreads every coordinate over all the others with equal weight: one outlier channel of the
residual stream becomes n channels of 1/sqrt(n) its size, which is what makes rotated weights and activations
easier to quantize (QuaRot, SpinQuant). Orders built here:

- Sylvester: 2^k, by H_2k = [[H, H], [H, -H]];
- Paley I: q + 1 for a prime q = 3 (mod 4), from the Jacobsthal matrix of the quadratic residues mod q;
- Paley II: 2(q + 1) for a prime q = 1 (mod 4);
- Kronecker products of these: the order 576 of SmolLM2's hidden size is 8 x 72 (Paley I, q = 71), 3584
  (Qwen2.5-7B) is 128 x 28 (Paley II, q = 13).

Hadamard matrices exist only for orders 1, 2 and multiples of 4; an order none of these constructions reaches
gets a random orthogonal matrix instead (QR of a Gaussian matrix), and the caller records which kind it used.
"""

from __future__ import annotations

import math
from functools import lru_cache

import torch


def _is_prime(q: int) -> bool:
    return q >= 2 and all(q % p for p in range(2, math.isqrt(q) + 1))


def _jacobsthal(q: int) -> torch.Tensor:
    """Q[i, j] = chi(j - i) for the quadratic character chi of the prime field GF(q)."""
    residues = {(x * x) % q for x in range(1, q)}
    chi = torch.tensor([0] + [1 if a in residues else -1 for a in range(1, q)], dtype=torch.float64)
    i = torch.arange(q)
    return chi[(i[None, :] - i[:, None]) % q]


def _paley1(q: int) -> torch.Tensor:
    """Order q + 1, q prime and 3 mod 4: H = I + S with S = [[0, 1^T], [-1, Q]] skew-symmetric."""
    n = q + 1
    s = torch.zeros(n, n, dtype=torch.float64)
    s[0, 1:] = 1
    s[1:, 0] = -1
    s[1:, 1:] = _jacobsthal(q)
    return torch.eye(n, dtype=torch.float64) + s


def _paley2(q: int) -> torch.Tensor:
    """Order 2(q + 1), q prime and 1 mod 4: the symmetric conference matrix C = [[0, 1^T], [1, Q]] with each
    0 replaced by [[1, -1], [-1, -1]] and each +-1 by +-[[1, 1], [1, -1]]."""
    n = q + 1
    c = torch.zeros(n, n, dtype=torch.float64)
    c[0, 1:] = 1
    c[1:, 0] = 1
    c[1:, 1:] = _jacobsthal(q)
    one = torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64)
    zero = torch.tensor([[1.0, -1.0], [-1.0, -1.0]], dtype=torch.float64)
    return torch.kron(c, one) + torch.kron(torch.eye(n, dtype=torch.float64), zero)


def _base_orders() -> dict[int, str]:
    """Orders with a direct construction (besides powers of two), up to 1024: order -> construction."""
    out: dict[int, str] = {}
    for q in range(3, 1024):
        if _is_prime(q) and q % 4 == 3:
            out.setdefault(q + 1, "paley1")
        if _is_prime(q) and q % 4 == 1 and 2 * (q + 1) <= 1024:
            out.setdefault(2 * (q + 1), "paley2")
    return out


_BASES = _base_orders()


def hadamard_order_kind(n: int) -> tuple[int, str] | None:
    """(m, construction) with n = 2^k * m that `hadamard` uses, or None when none is known."""
    if n >= 1 and n & (n - 1) == 0:
        return 1, "sylvester"
    m, k = n, 0
    while m % 2 == 0:
        m //= 2
        k += 1
    # try the odd part times each power of two: n = 2^j * (m * 2^(k - j)), largest base first
    for j in range(k + 1):
        base = m * 2 ** (k - j)
        if base in _BASES:
            return base, _BASES[base]
    return None


@lru_cache(maxsize=16)
def hadamard(n: int) -> torch.Tensor:
    """A Hadamard matrix of order n (float64, entries +-1). Raises ValueError when no construction here
    reaches n (see `hadamard_order_kind`)."""
    found = hadamard_order_kind(n)
    if found is None:
        raise ValueError(f"no Hadamard matrix of order {n} is built here (orders 2^k * (q + 1) and "
                         "2^k * 2(q + 1) for primes q)")
    m, kind = found
    h = torch.ones(1, 1, dtype=torch.float64)
    if kind == "paley1":
        h = _paley1(m - 1)
    elif kind == "paley2":
        h = _paley2(m // 2 - 1)
    two = torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.kron(two, h)
    return h


def rotation(n: int, seed: int, randomize: bool = True) -> tuple[torch.Tensor, str]:
    """An orthogonal n x n matrix (float64) and its kind: a Hadamard matrix / sqrt(n), with its rows' signs
    drawn at random from `seed` when `randomize` (QuaRot's randomized Hadamard), or, when no Hadamard of order
    n is built here, a random orthogonal matrix from `seed`."""
    gen = torch.Generator().manual_seed(seed)
    try:
        h = hadamard(n) / math.sqrt(n)
        kind = "hadamard"
    except ValueError:
        a = torch.randn(n, n, generator=gen, dtype=torch.float64)
        qm, r = torch.linalg.qr(a)
        return qm * torch.sign(torch.diagonal(r))[None, :], "random orthogonal"
    if randomize:
        signs = torch.randint(0, 2, (n,), generator=gen, dtype=torch.float64) * 2 - 1
        h = signs[:, None] * h
        kind = "randomized hadamard"
    return h, kind
