"""The block tables' digests a rank sends with each check, kept across checks.

Per group, the ordered digest (``digest.ordered_digests``) of ``req_index, len(row), *row``
over the step's requests in order: the ranks' digests must agree (one table, every rank).
An ordered digest is a sum of one term per position (the pair's hash mixed with its place),
so a row that stays at its place in the sequence keeps its terms: ``TableDigests`` keeps each
(group, request) row's place, its entries as last digested and the sum of their terms, and a
check compares the row with those entries (at memory speed) and hashes only the entries that
changed, were appended or were cut off. A row is the whole context (164K entries at 10M
tokens) while a step adds a few; the digest is the same number as from scratch.
"""

from __future__ import annotations

import numpy as np

from dcpsim.verify.digest import as_int64s, ordered_terms


def _terms(values: np.ndarray, first_place: int) -> int:
    """The sum (mod 2**64) of the terms of ``values`` at places ``first_place, first_place + 1, ...``."""
    if not len(values):
        return 0
    places = np.arange(first_place, first_place + len(values), dtype=np.int64)
    return int(ordered_terms(values, np.zeros(len(values), np.int64), places).sum(dtype=np.uint64))


class TableDigests:
    def __init__(self):
        self._kept: dict[tuple[int, int], tuple[int, np.ndarray, int]] = {}
        """(group, request) -> (the place of its row's first entry, the row as digested, the
        sum of the row's terms)."""

    def digests(self, num_groups: int, req_indices: list[int], table: list[np.ndarray]) -> np.ndarray:
        """Per group, the digest of the requests ``req_indices`` in order (``table``: their
        rows, group by group), as int64s. Forgets the rows of requests not in the step."""
        kept, self._kept = self._kept, {}
        mask = (1 << 64) - 1
        out = np.zeros(num_groups, dtype=np.uint64)
        n = len(req_indices)
        for g in range(num_groups):
            total, place = 0, 1  # places count from 1 within a group's sequence
            for req, row in zip(req_indices, table[g * n : (g + 1) * n]):
                row = np.asarray(row, dtype=np.int64)
                total += _terms(np.array([req, len(row)], dtype=np.int64), place)
                body = self._body(kept.get((g, req)), row, place + 2)
                self._kept[(g, req)] = (place + 2, row, body)
                total += body
                place += len(row) + 2
            out[g] = total & mask
        return as_int64s(out)

    @staticmethod
    def _body(before: tuple[int, np.ndarray, int] | None, row: np.ndarray, first: int) -> int:
        """The sum of ``row``'s terms from place ``first``, from what was kept where it can be."""
        if before is None or before[0] != first:
            return _terms(row, first)
        _, old, body = before
        m = min(len(old), len(row))
        changed = np.flatnonzero(old[:m] != row[:m])
        body -= _terms_at(old, changed, first) + _terms(old[m:], first + m)
        body += _terms_at(row, changed, first) + _terms(row[m:], first + m)
        return body & ((1 << 64) - 1)


def _terms_at(row: np.ndarray, columns: np.ndarray, first: int) -> int:
    """The sum of the terms of ``row``'s entries at ``columns`` (places ``first + column``)."""
    if not len(columns):
        return 0
    return int(ordered_terms(row[columns], np.zeros(len(columns), np.int64), first + columns).sum(dtype=np.uint64))
