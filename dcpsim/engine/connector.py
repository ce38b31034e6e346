"""The engine side of a KV connector (disaggregated prefill/decode).

* ``KVConnector.routes``: which prefill rank's local indices go to which decode rank's
  (``NixlConnector``: whole blocks, ``ReshardingConnector``: position by position; the math
  is ``dcpsim.model.connector``).
* ``read_pages``: a prefill rank reads a finished prompt's pages through its block table,
  as NIXL reads the remote blocks: entry ``l`` of the result is local index ``l``.
* ``PromptLoads``: the scheduler side of the decode instance's connector (vLLM's
  ``get_num_new_matched_tokens``): a request's prompt KV is loaded on its first admission,
  all but the last prompt token counted as computed (vLLM recomputes that one so the next
  token can be sampled: ``Scheduler._update_waiting_for_remote_kv``). Every engine's
  scheduler takes it (``Engine.make_scheduler(..., connector=...)``); ``LoadedScheduler``
  is dcpsim's scheduler with it.
* ``write_loaded``: a decode rank writes the received entries at the slots its own block
  table gives for their local indices, before the step that admitted the request runs.
* ``KVConnector.notices``: the completion each decode rank is notified of, per prompt (every
  decode rank, one that owns none of it too), with the entries it received and those on its final
  page (P/D class 7, sglang#32837).
* ``PrefillBlocks``: a prefill rank's blocks of finished prompts, held for the decode ranks'
  pulls and freed by ``PrefillRelease`` (after the last pull the transfer plan expects of a
  block; a block nobody pulls when the transfer ends): each block freed exactly once, and
  never pulled once freed (P/D class 6, vllm-ascend#5224).
"""

from __future__ import annotations

from collections import Counter

import numpy as np

from dcpsim.engine.scheduler.request import Request
from dcpsim.engine.scheduler.scheduler import Scheduler
from dcpsim.engine.worker.model_runner import ModelRunner
from dcpsim.model.connector import InstanceLayout, Route, block_matches, token_routes
from dcpsim.model.kv_entry import EMPTY, FIELDS, GROUP
from dcpsim.model.plan import StepPlan


class KVConnector:
    name = ""

    def routes(self, num_tokens: int, src: InstanceLayout, dst: InstanceLayout) -> list[Route]:
        raise NotImplementedError

    def notices(self, routes: list[Route], dst: InstanceLayout) -> dict[int, tuple[int, int]]:
        """The completion of a prompt's transfer each decode rank is notified of: decode rank ->
        (entries it received, entries on its final page of ``B``). Every decode rank gets one, a
        rank that owns none of the prompt too (0, 0): it waits for it as the others do
        (sglang#32837; P/D class 7)."""
        got = Counter()
        for route in routes:
            got[route.dst_rank] += len(route.dst_local)
        return {d: (got[d], final_page_entries(got[d], dst.block_size)) for d in range(dst.cp_size)}


def final_page_entries(entries: int, block_size: int) -> int:
    """Entries on the last of the pages ``entries`` local entries fill (0: none)."""
    return entries - (-(-entries // block_size) - 1) * block_size if entries else 0


class NixlConnector(KVConnector):
    """vLLM's NixlConnector: decode rank ``d`` pulls global blocks ``d, d + N_dst, ...``,
    each whole from the prefill rank holding it."""

    name = "nixl"

    def routes(self, num_tokens, src, dst):
        return block_matches(num_tokens, src, dst)


class ReshardingConnector(KVConnector):
    """Moves every position from its prefill owner to its decode owner: any two layouts."""

    name = "resharding"

    def routes(self, num_tokens, src, dst):
        return token_routes(num_tokens, src, dst)


CONNECTORS = {c.name: c for c in (NixlConnector, ReshardingConnector)}


def read_pages(runner: ModelRunner, group: int, row: np.ndarray) -> np.ndarray:
    """``[len(row) * B, 5]``: the entries of the blocks of ``row`` of one group, in local order."""
    store = runner.stores[group]
    row = np.array(row, dtype=np.int64)  # a copy: torch warns on indexing with a read-only view
    return store.data[row].reshape(-1, len(FIELDS)).numpy().copy()


def gather_entries(pages: np.ndarray, local: np.ndarray) -> np.ndarray:
    """The entries at local indices ``local`` (EMPTY rows past the pages)."""
    out = np.full((len(local), len(FIELDS)), EMPTY, dtype=np.int64)
    ok = (local >= 0) & (local < len(pages))
    out[ok] = pages[local[ok]]
    return out


class PromptLoads:
    """The decode instance's connector, as its scheduler sees it: prompts arrive with their
    KV (see the module doc). A preempted request recomputes locally, as in vLLM.

    An engine that runs its own connector's scheduler side (vLLM's NIXL scheduler,
    ``dcpsim.engine.vllm.nixl_scheduler``) reads ``kind`` (the run's connector), ``remote``
    (request -> the prefill instance's block ids per group) and ``prefill`` (its sizes), and
    records in ``pulls`` (request -> group -> (first block, block ids)) the blocks its code chose
    to fill; ``write_loaded`` then writes there."""

    def __init__(self, kind: str = "", remote: dict | None = None, prefill: dict | None = None, load_steps: int = 0):
        self.kind = kind
        self.remote: dict[int, list] = remote or {}
        self.prefill: dict = prefill or {}
        self.pulls: dict[int, dict[int, tuple[int, list[int]]]] = {}
        self.load_steps = load_steps
        """Steps an asynchronous load takes (``[disaggregated] load_steps``; 0: the prompt's KV is
        written before the step that admits the request). With it the scheduler is
        ``engine.async_load.AsyncLoadScheduler``, which fills the two records below."""
        self.load_parts: dict[int, list[tuple[int, int, int]]] = {}
        """Step -> (request, part, parts): the part of a request's prompt KV that arrives before the
        step's write (``engine.async_load.write_part``); the last part completes the load."""
        self.to_zero: dict[int, dict[int, list[int]]] = {}
        """Step -> group -> the block ids newly allocated in that step that the decode ranks clear
        before it writes (vLLM's ``new_block_ids_to_zero``), less those an asynchronous load fills."""

    def external_tokens(self, req: Request) -> int:
        """Tokens of ``req`` the connector loads on admission (vLLM's ``get_num_new_matched_tokens``)."""
        return 0 if req.num_preemptions else req.spec.prompt_len - 1


PROMPT_LOADS = PromptLoads()


class LoadedScheduler(Scheduler):
    """dcpsim's scheduler of a decode instance (``PromptLoads``): the parent's dry run."""

    def __init__(self, scenario, engine, geometries):
        super().__init__(scenario, engine, geometries, connector=PROMPT_LOADS)


def pulled_row(pull: tuple[int, list[int]]) -> np.ndarray:
    """A request's row as an engine's connector chose to fill it: ``-1`` for the blocks before
    ``first`` (held already, not pulled), then the chosen block ids."""
    first, ids = pull
    return np.asarray([-1] * first + list(ids), dtype=np.int64)


def write_loaded(plan: StepPlan, runner: ModelRunner, received: dict, pulls: dict | None = None) -> int:
    """Write the entries of every request ``plan`` admits with loaded KV; ``received[req][group]``
    is (decode local indices, entries). With ``pulls`` (``PromptLoads.pulls``), a request's entries
    go to the blocks its engine's connector chose (none before the first chosen one, none past the
    last), else to its row in the plan. Returns the entries written."""
    count = 0
    for req_index, _ in plan.loaded:
        for g, (geometry, store) in enumerate(zip(runner.geometries, runner.stores)):
            local, entries = received.get(req_index, {}).get(g, (np.zeros(0, np.int64), None))
            if not len(local):
                continue
            chosen = (pulls or {}).get(req_index, {}).get(g)
            row = pulled_row(chosen) if chosen is not None else np.asarray(plan.rows_before[g][req_index], dtype=np.int64)
            count += len(write_entries(geometry.group_id, store, row, local, entries))
    return count


def write_entries(group_id: int, store, row: np.ndarray, local: np.ndarray, entries: np.ndarray) -> np.ndarray:
    """Write received ``entries`` at local indices ``local`` through block-table ``row`` (none
    past the row, none at a ``-1`` entry, no EMPTY entry); the local indices written."""
    page = store.states_per_page
    block = local // page
    ok = (block < len(row)) & (entries[:, GROUP] != EMPTY)
    ok[ok] = row[block[ok]] >= 0
    slots = row[block[ok]] * page + local[ok] % page
    rows = entries[ok].copy()
    rows[:, GROUP] = group_id
    store.write(slots, rows)
    return local[ok]


class PrefillRelease:
    """When a prefill rank frees a finished prompt's block: once the decode ranks have made
    every pull of it the transfer plan expects (``expected``, the routes that read it), and a
    block no route reads (past the prompt, or on a rank whose shard another rank serves) when
    the transfer ends (``pulls == expected == 0``)."""

    def frees(self, pulls: int, expected: int) -> bool:
        return pulls == expected


class PrefillBlocks:
    """One prefill rank's blocks of finished prompts during the transfer: ``pages[req][group]``
    (``read_pages``), ``rows[req][group]`` their block ids, ``page_sizes[group]`` the entries a
    block holds. ``expect`` counts the pulls of each block the routes make; ``pull`` serves one
    route (a freed block reads as EMPTY: the prefill instance may have handed it to another
    request) and frees what ``release`` says; ``finish`` frees the blocks nobody pulled and
    returns what went wrong, naming the rank and the block."""

    def __init__(self, rank: int, pages: dict, rows: dict, page_sizes: list[int], names: dict, release: PrefillRelease):
        self.rank, self.pages, self.rows, self.page_sizes, self.names, self.release = rank, pages, rows, page_sizes, names, release
        held = [(i, g, b) for i, by_g in pages.items() for g, p in by_g.items() for b in range(len(p) // page_sizes[g])]
        self.expected: Counter = Counter(dict.fromkeys(held, 0))
        """(request, group, block) -> the pulls the routes make of it (0: freed when the transfer ends)."""
        self.pulls: Counter = Counter()
        self.frees: Counter = Counter()
        self.read_freed: list[tuple] = []

    def _blocks(self, req: int, group: int, local: np.ndarray) -> list[int]:
        n = len(self.pages.get(req, {}).get(group, ()))
        if not n:  # not read (the prefill run stopped before the prompt finished): nothing held
            return []
        local = np.asarray(local, np.int64)
        return np.unique(local[(local >= 0) & (local < n)] // self.page_sizes[group]).tolist()

    def expect(self, req: int, group: int, local: np.ndarray) -> None:
        for b in self._blocks(req, group, local):
            self.expected[(req, group, b)] += 1

    def pull(self, req: int, group: int, local: np.ndarray, empty: np.ndarray) -> np.ndarray:
        local = np.asarray(local, np.int64)
        entries = gather_entries(self.pages.get(req, {}).get(group, empty), local)
        for b in self._blocks(req, group, local):
            key = (req, group, b)
            if self.frees[key]:
                entries[local // self.page_sizes[group] == b] = EMPTY
                self.read_freed.append(key)
            self.pulls[key] += 1
            if self.release.frees(self.pulls[key], self.expected[key]):
                self.frees[key] += 1
        return entries

    def finish(self) -> list[str]:
        for key, n in self.expected.items():
            if n == 0 and self.release.frees(0, 0):
                self.frees[key] += 1
        problems = []
        for key in dict.fromkeys(self.read_freed):
            problems.append(f"{self._name(key)} pulled after it was freed ({self.pulls[key]} of {self.expected[key]} pulls)")
        for key in self.expected:
            if self.frees[key] != 1:
                problems.append(f"{self._name(key)} freed {self.frees[key]} times, expected once")
        return problems

    def _name(self, key) -> str:
        req, group, b = key
        row = self.rows.get(req, {}).get(group, ())
        block_id = int(row[b]) if b < len(row) else -1
        return f"prefill rank {self.rank}: request {self.names.get(req, req)} group {group} block {b} (id {block_id})"
