"""The block tables' digests a rank sends with each check, kept across checks.

Per group, the ordered digest (``digest.ordered_digests``) of ``req_index, len(row), *row``
over the step's requests in order: the ranks' digests must agree (one table, every rank).
An ordered digest is a sum of one term per position (the pair's hash mixed with its place),
so a row that stays at its place in the sequence keeps its terms: ``TableDigests`` keeps each
(group, request) row's place, its entries as last digested and the sum of their terms, and a
check compares the row with those entries (at memory speed) and hashes only the entries that
changed, were appended or were cut off. A row is the whole context (164K entries at 10M
tokens) while a step adds a few; the digest is the same number as from scratch.

The terms of a check are hashed in one pass: every (group, request) lists the pieces it
needs (its header ``req_index, len(row)``, and its whole row or only the entries that
changed, were appended or were cut off), and one ``ordered_terms`` call over all the pieces,
then a segment sum, gives each piece's sum (mod 2**64, so the grouping changes no digest).

A group whose rows are short (fewer than ``scratch_below`` entries in all: every matrix
cell) is digested from scratch instead, all such groups in one ``ordered_digests`` pass over
their sequences (a group's places run from 1 over its whole sequence): the bookkeeping per
row costs more than hashing a few hundred entries. Its rows are not kept; should it grow
past the limit, its rows are hashed whole once, then kept.
"""

from __future__ import annotations

import numpy as np

from dcpsim.verify.digest import as_int64s, ordered_digests, ordered_terms

_MASK = (1 << 64) - 1
SCRATCH_BELOW = 4096
"""Entries of a group's rows below which it is digested from scratch (``TableDigests``)."""


class _Pieces:
    """Values and their places to hash in one ``ordered_terms`` pass; ``add`` returns the
    piece's number, ``sums()`` each piece's sum of terms (mod 2**64) as Python ints."""

    def __init__(self):
        self.values: list[np.ndarray] = []
        self.places: list[np.ndarray] = []

    def add(self, values: np.ndarray, places: np.ndarray) -> int:
        self.values.append(values)
        self.places.append(places)
        return len(self.values) - 1

    def add_run(self, values: np.ndarray, first: int) -> int:
        return self.add(values, np.arange(first, first + len(values), dtype=np.int64))

    def sums(self) -> list[int]:
        if not self.values:
            return []
        lengths = np.array([len(v) for v in self.values], dtype=np.int64)
        values = np.concatenate(self.values).astype(np.int64, copy=False)
        terms = ordered_terms(values, np.zeros(len(values), np.int64), np.concatenate(self.places))
        running = np.zeros(len(terms) + 1, dtype=np.uint64)
        np.cumsum(terms, dtype=np.uint64, out=running[1:])
        ends = np.cumsum(lengths)
        return (running[ends] - running[ends - lengths]).tolist()  # wraps mod 2**64


def _sequence(req_indices: list[int], lengths: np.ndarray, flat: np.ndarray) -> np.ndarray:
    """A group's digested sequence ``req_index, len(row), *row`` over its requests in order
    (``flat``: the rows concatenated, ``lengths``: theirs)."""
    heads = np.cumsum(lengths + 2) - (lengths + 2)
    seq = np.empty(len(flat) + 2 * len(lengths), dtype=np.int64)
    body = np.ones(len(seq), dtype=bool)
    body[heads] = body[heads + 1] = False
    seq[heads] = req_indices
    seq[heads + 1] = lengths
    seq[body] = flat
    return seq


class TableDigests:
    def __init__(self, scratch_below: int = SCRATCH_BELOW):
        self.scratch_below = scratch_below
        self._kept: dict[tuple[int, int], tuple[int, np.ndarray, int]] = {}
        """(group, request) -> (the place of its row's first entry, the row as digested, the
        sum of the row's terms)."""
        self._same: dict[int, tuple] = {}
        """Group -> ((its requests, their rows' lengths), the rows concatenated, its digest) at the last call."""

    def digests(self, num_groups: int, req_indices: list[int], table: list[np.ndarray], flats: list | None = None) -> np.ndarray:
        """Per group, the digest of the requests ``req_indices`` in order (``table``: their
        rows, group by group), as int64s. Forgets the rows of requests not in the step. A
        group whose requests and rows are those of the last call keeps its digest: most
        steps change no row (``_unchanged``; ``flats``: each group's rows concatenated, if known)."""
        kept, self._kept = self._kept, {}
        same, self._same = self._same, {}
        n = len(req_indices)
        pieces = _Pieces()
        plans = []  # per (group, request): (group, key, place, row, kept body, [(sign, piece)]), header first
        out = [0] * num_groups
        small: list[int] = []  # groups digested from scratch
        for g in range(num_groups):
            if self._unchanged(g, same.get(g), req_indices, table[g * n : (g + 1) * n], None if flats is None else flats[g]):
                out[g] = self._same[g][2]
                for req in req_indices:
                    if (g, req) in kept:  # a small group keeps no rows
                        self._kept[(g, req)] = kept[(g, req)]
                continue
            if len(self._same[g][1]) < self.scratch_below:
                small.append(g)
                continue
            place = 1  # places count from 1 within a group's sequence
            for req, row in zip(req_indices, table[g * n : (g + 1) * n]):
                row = np.asarray(row, dtype=np.int64)
                header = pieces.add_run(np.array([req, len(row)], dtype=np.int64), place)
                body, parts = self._body_pieces(kept.get((g, req)), row, place + 2, pieces)
                plans.append((g, (g, req), place + 2, row, body, [(1, header)] + parts))
                place += len(row) + 2
        sums = pieces.sums()
        for g, key, first, row, body, parts in plans:
            header, parts = sums[parts[0][1]], parts[1:]
            for sign, piece in parts:
                body += sign * sums[piece]
            body &= _MASK
            self._kept[key] = (first, row, body)
            out[g] += header + body
        if small:
            seqs = [_sequence(req_indices, np.array(self._same[g][0][1], dtype=np.int64), self._same[g][1]) for g in small]
            flat = np.concatenate(seqs) if len(seqs) > 1 else seqs[0]
            lengths = np.array([len(x) for x in seqs], dtype=np.int64)
            for g, total in zip(small, ordered_digests(flat, np.zeros(len(flat), np.int64), lengths).tolist()):
                out[g] = total
        out = [total & _MASK for total in out]
        for g, total in enumerate(out):
            self._same[g] = (*self._same[g][:2], total)
        return as_int64s(np.array(out, dtype=np.uint64))

    def _unchanged(self, g: int, before: tuple | None, req_indices: list[int], rows: list[np.ndarray], flat=None) -> bool:
        """Whether group ``g``'s requests and rows are those of the last call (``before``: what
        it kept then), by one comparison of the rows concatenated; keeps them for the next call."""
        signature = (tuple(req_indices), tuple(len(row) for row in rows))
        if flat is None:
            flat = np.concatenate(rows) if len(rows) > 1 else np.array(rows[0]) if rows else np.zeros(0, np.int64)
        if before is not None and before[0] == signature and bool((before[1] == flat).all()):
            self._same[g] = before
            return True
        self._same[g] = (signature, flat)
        return False

    @staticmethod
    def _body_pieces(before: tuple[int, np.ndarray, int] | None, row: np.ndarray, first: int, pieces: _Pieces):
        """The pieces whose terms turn what was kept of a row into ``row``'s sum of terms from
        place ``first``: ``(the kept sum, [(sign, piece)])`` (the whole row when nothing fits)."""
        if before is None or before[0] != first:
            return 0, [(1, pieces.add_run(row, first))] if len(row) else []
        _, old, body = before
        m = min(len(old), len(row))
        changed = np.flatnonzero(old[:m] != row[:m])
        parts = []
        if len(changed):
            places = first + changed
            parts += [(-1, pieces.add(old[changed], places)), (1, pieces.add(row[changed], places))]
        if len(old) > m:
            parts.append((-1, pieces.add_run(old[m:], first + m)))
        if len(row) > m:
            parts.append((1, pieces.add_run(row[m:], first + m)))
        return body, parts
