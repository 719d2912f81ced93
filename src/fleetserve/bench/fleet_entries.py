"""Fleet-file model entries (`fleetserve serve --config`) as YAML text, for the benches and
tests that write a fleet file: one builder per entry shape, so a generate model, an
embedder, a custom handler and the embed-then-answer graph read the same everywhere.

Each function returns the entry's lines, indented for the `models:` list and ending in a
newline; `fleet_file` joins them under `models:` with any trailing sections (classes).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping


def _flow(pairs: Mapping[str, object]) -> str:
    """A YAML flow mapping of plain scalars: `{a: 1, b: x}`."""
    return "{" + ", ".join(f"{k}: {v}" for k, v in pairs.items()) + "}"


def generate_entry(
    name: str,
    model: str,
    *,
    max_num_seqs: int,
    max_model_len: int,
    num_threads: int | None = None,
    replicas: int | None = None,
) -> str:
    """A generate model: its checkpoint and engine limits (num_threads when pinned)."""
    engine: dict[str, object] = {"max_num_seqs": max_num_seqs}
    if num_threads is not None:
        engine["num_threads"] = num_threads
    engine["max_model_len"] = max_model_len
    lines = [f"  - name: {name}", f"    model: {model}"]
    if replicas is not None:
        lines.append(f"    replicas: {replicas}")
    lines.append(f"    engine: {_flow(engine)}")
    return "\n".join(lines) + "\n"


def _batching(max_batch_size: int | None, batch_wait_timeout_s: float) -> str:
    if max_batch_size is None:
        return ""
    pairs = {"max_batch_size": max_batch_size, "batch_wait_timeout_s": batch_wait_timeout_s}
    return f"    batching: {_flow(pairs)}\n"


def embed_entry(
    name: str = "minilm", *, max_batch_size: int | None = None, batch_wait_timeout_s: float = 0.01
) -> str:
    """An embedding model (all-MiniLM-L6-v2 by default), micro-batched when max_batch_size
    is given."""
    return f"  - name: {name}\n    kind: embed\n" + _batching(max_batch_size, batch_wait_timeout_s)


def custom_entry(
    name: str,
    handler: str,
    *,
    options: str | None = None,
    timeout_s: float | None = None,
    max_batch_size: int | None = None,
    batch_wait_timeout_s: float = 0.01,
) -> str:
    """A custom handler (`module:Class`), with its options as a YAML flow mapping."""
    lines = [f"  - name: {name}", "    kind: custom", f"    handler: {handler}"]
    if options is not None:
        lines.append(f"    options: {options}")
    if timeout_s is not None:
        lines.append(f"    timeout_s: {timeout_s}")
    return "\n".join(lines) + "\n" + _batching(max_batch_size, batch_wait_timeout_s)


def graph_entry(
    name: str,
    root_type: str,
    steps: Iterable[str],
    *,
    timeout_s: float | None = None,
    seed: int | None = None,
) -> str:
    """A graph of one root node (`sequence`, `switch`, `ensemble`, `splitter`): each step is
    the YAML of one list item (a flow mapping, or block lines indented from the item's
    first); timeout_s for the whole graph, seed for a splitter."""
    lines = [f"  - name: {name}", "    kind: graph", "    graph:"]
    if timeout_s is not None:
        lines.append(f"      timeout_s: {timeout_s}")
    lines += ["      nodes:", "        root:", f"          type: {root_type}"]
    if seed is not None:
        lines.append(f"          seed: {seed}")
    lines.append("          steps:")
    for step in steps:
        first, *rest = step.split("\n")
        lines.append(f"            - {first}")
        lines.extend(f"              {line}" for line in rest)
    return "\n".join(lines) + "\n"


def rag_graph_entry(name: str, *, embedder: str, chat: str, max_tokens: int) -> str:
    """The embed-then-answer graph: embed the last message with `embedder`, then ask `chat`
    (greedy, `max_tokens`) with the vector's first value as its system "context"."""
    embed = f'{{model: {embedder}, name: vec, input: {{input: "$request.messages[-1].content"}}}}'
    answer = [
        f"model: {chat}",
        "input:",
        f"  max_tokens: {max_tokens}",
        "  temperature: 0.0",
        "  messages:",
        '    - {role: system, content: "Context: {$steps.vec.data[0].embedding[0]}"}',
        '    - "$request.messages[-1]"',
    ]
    return graph_entry(name, "sequence", [embed, "\n".join(answer)])


def fleet_file(entries: Iterable[str], tail: str = "") -> str:
    """A whole fleet file: `models:` with the entries, then `tail` (classes, ...)."""
    return "models:\n" + "".join(entries) + tail
