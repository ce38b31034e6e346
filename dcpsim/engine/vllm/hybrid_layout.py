"""Which KV cache manager layout vLLM picks for a scenario: its configuration rule, then its
layout function, both from the source tree.

vLLM's ``VllmConfig.__post_init__`` (``vllm/config/vllm.py``, ``releases.HYBRID_RULE``) turns the
hybrid KV cache manager off for a model with an ``attention_chunk_size`` (here: a scenario with a
chunked-local layer): always beside an EAGLE-style drafter (``speculative_config.use_eagle()``,
``uses_target_hidden_states`` in 0.34.0), else unless the environment sets
``VLLM_ALLOW_CHUNKED_LOCAL_ATTN_WITH_HYBRID_KV_CACHE=1`` (``--vllm-allow-chunked-local-hybrid``).
The rule is read from the tree with ``ast`` (``read_rule``: its lines are quoted, nothing imported);
a tree without it keeps the manager on.

With the manager off, vLLM's ``get_kv_cache_groups`` first calls ``unify_hybrid_kv_cache_specs``
(``releases.KV_LAYOUT``), run here on vLLM's specs of the scenario's layers: layers whose spec it
promotes (a chunked-local or sliding-window layer beside full attention, sharded and replicated
layers apart from 0.31.0) are stored as full attention. dcpsim does not run that unified layout
(the checker judges each layer by its own kind, and the engine's groups would merge layers the
scenario keeps apart): such a scenario is exit 2, quoting the rule and the promotion. Where the
function promotes nothing (a replicated chunked-local group alone among replicated layers), the
layout is the hybrid one dcpsim builds, and vLLM runs it as such.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from dcpsim.model.specs import ChunkedLocalAttentionSpec

ENV = "VLLM_ALLOW_CHUNKED_LOCAL_ATTN_WITH_HYBRID_KV_CACHE"
FLAG = "--vllm-allow-chunked-local-hybrid"
RULE_FILE = "vllm/config/vllm.py"


@dataclass(frozen=True)
class Rule:
    """vLLM's rule for chunked local attention, as the tree's ``VllmConfig.__post_init__`` has it."""

    first: int
    last: int
    """The lines of the ``if ... attention_chunk_size is not None:`` block."""
    drafter: str = ""
    """The drafter's test that turns the manager off whatever the environment says (its source)."""
    drafter_line: int = 0
    env_line: int = 0
    """The line of the ``elif not envs.VLLM_ALLOW_...`` test (0: the tree has no such switch)."""

    def where(self) -> str:
        return f"{RULE_FILE}:{self.first}-{self.last}"


@dataclass(frozen=True)
class Layout:
    """The manager layout vLLM picks for a scenario."""

    hybrid: bool
    """vLLM's hybrid KV cache manager runs (the groups dcpsim builds)."""
    why: str
    promoted: tuple[str, ...] = ()
    """Layers ``unify_hybrid_kv_cache_specs`` stores as full attention (the manager off)."""
    into: str = ""
    """What they become (vLLM's spec class and block size)."""

    def describe(self) -> str:
        text = f"vLLM's hybrid KV cache manager {self.why}"
        if self.hybrid:
            return text
        if not self.promoted:
            return f"{text}; with it off, unify_hybrid_kv_cache_specs promotes no layer: the groups are those below"
        return f"{text}; with it off, unify_hybrid_kv_cache_specs stores the layers {', '.join(self.promoted)} as {self.into}"


def _source(node, lines: list[bytes]) -> str:
    """``node``'s source text with its whitespace collapsed. ``lines``: the file's lines, split
    once (``ast.get_source_segment`` splits the whole file again on every call: 2 s a process
    on ``vllm/config/vllm.py``). Column offsets are UTF-8 byte offsets, as the AST gives them."""
    first, last = node.lineno - 1, node.end_lineno - 1
    if first == last:
        piece = lines[first][node.col_offset : node.end_col_offset]
    else:
        piece = lines[first][node.col_offset :] + b"".join(lines[first + 1 : last]) + lines[last][: node.end_col_offset]
    return " ".join(piece.decode("utf-8").split())


@lru_cache(maxsize=32)
def read_rule(root: str) -> Rule | None:
    """The chunked-local rule of ``VllmConfig.__post_init__`` in the tree at ``root``, or None."""
    path = Path(root) / RULE_FILE
    if not path.is_file():
        return None
    text = path.read_text(encoding="utf-8")
    tree = ast.parse(text)
    lines = text.encode("utf-8").splitlines(keepends=True)
    cls = next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "VllmConfig"), None)
    post = next((n for n in (cls.body if cls else ()) if isinstance(n, ast.FunctionDef) and n.name == "__post_init__"), None)
    if post is None:
        return None
    for node in ast.walk(post):
        if not (isinstance(node, ast.If) and "attention_chunk_size" in _source(node.test, lines)):
            continue
        rule = dict(first=node.lineno, last=node.end_lineno)
        for inner in ast.walk(node):
            if not isinstance(inner, ast.If) or inner is node:
                continue
            test = _source(inner.test, lines)
            if ENV in test:
                rule["env_line"] = inner.lineno
            elif "speculative_config" in test and "drafter" not in rule:
                rule["drafter"], rule["drafter_line"] = test, inner.lineno
        return Rule(**rule)
    return None


def has_chunk(layers: dict) -> bool:
    """Whether the scenario's model has an ``attention_chunk_size`` (a chunked-local layer)."""
    return any(isinstance(spec, ChunkedLocalAttentionSpec) for spec in layers.values())


def manager_on(rule: Rule | None, version: str, *, chunk: bool, eagle: bool, allow: bool) -> tuple[bool, str]:
    """Whether vLLM keeps its hybrid KV cache manager, and why (quoting the rule's lines)."""
    if not chunk:
        return True, "on (the model has no attention_chunk_size)"
    if rule is None:
        return True, f"on (vLLM {version}'s VllmConfig.__post_init__ has no rule for chunked local attention)"
    if eagle and rule.drafter:
        return False, (
            f"off for chunked local attention beside an EAGLE-style drafter, whatever {ENV} says "
            f"({RULE_FILE}:{rule.drafter_line}: if {rule.drafter})"
        )
    if not rule.env_line:
        return False, f"off for chunked local attention ({rule.where()})"
    if allow:
        return True, f"on: {ENV}=1 ({FLAG}) keeps it for chunked local attention ({RULE_FILE}:{rule.env_line})"
    return False, f"off for chunked local attention unless {ENV}=1 ({RULE_FILE}:{rule.env_line}; {FLAG} sets it)"
