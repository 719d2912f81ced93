"""The pipeline tests' fleet (graphs, cascades, custom handlers and their sub-calls): one
fleet file holding every model those modules use, served once per test session
(tests/server/conftest.py `pipeline_fleet`; one xdist unit in tests/conftest.py)."""

from __future__ import annotations

from fleetserve.bench.fleet_entries import (
    custom_entry,
    embed_entry,
    fleet_file,
    generate_entry,
    graph_entry,
    rag_graph_entry,
)

# test_server_cascade.py: cascades over the two tiers `small` and `large`.
CASCADES = """\
  - {name: up, kind: cascade, tiers: [small, large], escalate: {min_mean_logprob: 0.0}}
  - {name: stay, kind: cascade, tiers: [small, large],
      escalate: {min_mean_logprob: -1000000.0}}
  - {name: by_length, kind: cascade, tiers: [small, large],
      escalate: {max_tokens_hit: true}}
  - {name: by_regex, kind: cascade, tiers: [small, large], escalate: {must_match: "(?!)"}}
  - {name: by_schema, kind: cascade, tiers: [small, large],
      escalate: {must_match: {type: object}}}
  - {name: by_predicate, kind: cascade, tiers: [small, large],
      escalate: {predicate: "cascade_rules:longer_than_three"}}
  - {name: slow_up, kind: cascade, tiers: [small, large],
      escalate: {predicate: "cascade_rules:slow_then_up"}}
  - {name: early_up, kind: cascade, tiers: [small, large], decide_after_tokens: 2,
      escalate: {min_mean_logprob: 0.0}}
  - {name: early_stay, kind: cascade, tiers: [small, large], decide_after_tokens: 2,
      escalate: {min_mean_logprob: -1000000.0}}
"""
# test_server_graph.py: graphs over the classifier, the embedder and `tiny`.
GRAPHS = "".join(
    [
        graph_entry("route", "switch", [
            '{model: classifier, name: short, when: "$request.instances[0].text =~ ^a",\n'
            " input: {instances: [{text: short}]}}",
            "{model: classifier, name: long, input: {instances: [{text: longer}]}}",
        ]),
        graph_entry("both", "ensemble", [
            "{model: classifier}",
            '{model: minilm, input: {input: "$request.instances[0].text"}}',
        ]),
        graph_entry("ab", "splitter", [
            "{model: classifier, name: a, weight: 1}",
            "{model: classifier, name: b, weight: 1}",
        ], seed=1),
        graph_entry("tell", "sequence", [
            "{model: classifier}",
            '{model: tiny, input: {prompt: "Label: {$steps.classifier.predictions[0].label}",\n'
            "                       max_tokens: 5, temperature: 0.0}}",
        ]),
        graph_entry("slow", "sequence", [
            '{model: tiny, input: {prompt: "The sea", max_tokens: 400, ignore_eos: true}}',
            "{model: classifier, input: {instances: [{text: x}]}}",
        ], timeout_s=1.0),
    ]
)  # fmt: skip
CLASSES = """\
classes:
  interactive: {priority: 0}
  batch: {priority: 10}
default_class: interactive
"""


def pipeline_fleet_config(llama: str, llama7: str) -> str:
    """The fleet file. `llama`: the session's tiny llama; `llama7`: the same architecture,
    seed 7 (the cascade's large tier, which must answer unlike the small one). Handlers
    come from tests/ (fleet_handlers, pipeline_handlers, cascade_rules), which the fleet
    gets on PYTHONPATH."""
    tiers: dict[str, int] = {"max_num_seqs": 2, "num_threads": 1, "max_model_len": 256}
    classifier = "fleet_handlers:Classifier"
    return fleet_file(
        [
            # test_server_graph.py, test_server_fleet_client.py, test_server_handlers.py
            generate_entry("tiny", llama, max_num_seqs=4, num_threads=1, max_model_len=512),
            # test_server_cascade.py: two tiers and the cascades over them
            generate_entry("small", llama, **tiers),
            generate_entry("large", llama7, **tiers),
            CASCADES,
            # test_server_fleet_client.py: handlers that call `tiny` through the fleet
            custom_entry("composer", "pipeline_handlers:Complete", options="{model: tiny}",
                         timeout_s=3.0, max_batch_size=4),
            custom_entry("streamer", "pipeline_handlers:StreamComplete",
                         options="{model: tiny}", timeout_s=20.0),
            # test_server_handlers.py: a handler that misbehaves, and a good one beside it
            custom_entry("bad", "fleet_handlers:Misbehaves", timeout_s=4, max_batch_size=1,
                         batch_wait_timeout_s=0),
            custom_entry("good", classifier, options="{labels: [even, odd]}"),
            # test_server_graph.py: an embedder, a classifier and the graphs over them
            embed_entry(max_batch_size=8),
            custom_entry("classifier", classifier, options="{labels: [even, odd]}"),
            rag_graph_entry("rag", embedder="minilm", chat="tiny", max_tokens=6),
            GRAPHS,
        ],
        CLASSES,
    )  # fmt: skip


# Every engine step takes at least this long, so a long sub-call or graph step is still
# running when its parent's timeout, deadline or client ends it (the tiny models alone
# finish in a blink): 400 tokens run 8+ s.
PIPELINE_STEP_DELAY_S = "0.02"
