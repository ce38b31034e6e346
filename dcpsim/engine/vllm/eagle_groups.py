"""Which KV cache groups a vLLM tree gives EAGLE's last-block drop, read from the tree.

vLLM 0.33.0 and later flag every group holding a drafter layer (a spec with ``is_draft``) as an
EAGLE group when the drafter drops (``use_eagle_block_drop``), in ``kv_cache_planning.py``:
``group.is_eagle_group = not draft_layer_names.isdisjoint(group.layer_names)``; the coordinator
then drops only in those groups, and in every group when none is flagged. Older trees flag only
drafters they recognise by their spec or their trailing MTP layers (``_annotate_eagle_groups``,
vLLM 0.31.0..0.32.0), never a generic EAGLE drafter's group, or have no flag at all: every group
drops (the rule bug class 47 breaks). dcpsim hands vLLM's manager its groups as the tree would
flag them.
"""

from __future__ import annotations

from dcpsim.engine.loading.quote import quote

FILE = "vllm/v1/core/kv_cache_planning.py"
RULE = "group.is_eagle_group = not draft_layer_names.isdisjoint(group.layer_names)"


def flags_draft_groups(tree) -> bool:
    """Whether the tree flags the groups holding a drafter layer (vLLM 0.33.0 on)."""
    try:
        return RULE in (tree.root / FILE).read_text(encoding="utf-8")
    except OSError:
        return False


def mark(tree, vgroups, groups, config) -> str | None:
    """Set ``is_eagle_group`` on vLLM's groups ``vgroups`` (of dcpsim's ``groups``) as the tree
    would, for an EAGLE-style drafter whose layers are ``config.draft_layers``; what decided it
    (the quoted line), or None where the tree flags none."""
    if not (config.eagle_drop and config.draft_layers and flags_draft_groups(tree)):
        return None
    draft = set(config.draft_layers)
    for vgroup, group in zip(vgroups, groups):
        vgroup.is_eagle_group = not draft.isdisjoint(group.layer_names)
    return quote(tree, (FILE, RULE))
