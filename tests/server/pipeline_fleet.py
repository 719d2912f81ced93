"""The pipeline tests' fleet (graphs, cascades, custom handlers and their sub-calls): one
fleet file holding every model those modules use, served once per test session
(tests/server/conftest.py `pipeline_fleet`; one xdist unit in tests/conftest.py)."""

# `{llama}`: the session's tiny llama; `{llama7}`: the same architecture, seed 7 (the
# cascade's large tier, which must answer unlike the small one). Handlers come from tests/
# (fleet_handlers, pipeline_handlers, cascade_rules), which the fleet gets on PYTHONPATH.
PIPELINE_FLEET = """
models:
  # test_server_graph.py, test_server_fleet_client.py, test_server_handlers.py
  - name: tiny
    model: {llama}
    engine: {{max_num_seqs: 4, num_threads: 1, max_model_len: 512}}
  # test_server_cascade.py: two tiers and the cascades over them
  - name: small
    model: {llama}
    engine: {{max_num_seqs: 2, num_threads: 1, max_model_len: 256}}
  - name: large
    model: {llama7}
    engine: {{max_num_seqs: 2, num_threads: 1, max_model_len: 256}}
  - {{name: up, kind: cascade, tiers: [small, large], escalate: {{min_mean_logprob: 0.0}}}}
  - {{name: stay, kind: cascade, tiers: [small, large],
      escalate: {{min_mean_logprob: -1000000.0}}}}
  - {{name: by_length, kind: cascade, tiers: [small, large],
      escalate: {{max_tokens_hit: true}}}}
  - {{name: by_regex, kind: cascade, tiers: [small, large], escalate: {{must_match: "(?!)"}}}}
  - {{name: by_schema, kind: cascade, tiers: [small, large],
      escalate: {{must_match: {{type: object}}}}}}
  - {{name: by_predicate, kind: cascade, tiers: [small, large],
      escalate: {{predicate: "cascade_rules:longer_than_three"}}}}
  - {{name: slow_up, kind: cascade, tiers: [small, large],
      escalate: {{predicate: "cascade_rules:slow_then_up"}}}}
  - {{name: early_up, kind: cascade, tiers: [small, large], decide_after_tokens: 2,
      escalate: {{min_mean_logprob: 0.0}}}}
  - {{name: early_stay, kind: cascade, tiers: [small, large], decide_after_tokens: 2,
      escalate: {{min_mean_logprob: -1000000.0}}}}
  # test_server_fleet_client.py: handlers that call `tiny` through the fleet
  - name: composer
    kind: custom
    handler: pipeline_handlers:Complete
    options: {{model: tiny}}
    timeout_s: 3.0
    batching: {{max_batch_size: 4, batch_wait_timeout_s: 0.01}}
  - name: streamer
    kind: custom
    handler: pipeline_handlers:StreamComplete
    options: {{model: tiny}}
    timeout_s: 20.0
  # test_server_handlers.py: a handler that misbehaves, and a good one beside it
  - name: bad
    kind: custom
    handler: fleet_handlers:Misbehaves
    timeout_s: 4
    batching: {{max_batch_size: 1, batch_wait_timeout_s: 0}}
  - name: good
    kind: custom
    handler: fleet_handlers:Classifier
    options: {{labels: [even, odd]}}
  # test_server_graph.py: an embedder, a classifier and the graphs over them
  - name: minilm
    kind: embed
    batching: {{max_batch_size: 8, batch_wait_timeout_s: 0.01}}
  - name: classifier
    kind: custom
    handler: fleet_handlers:Classifier
    options: {{labels: [even, odd]}}
  - name: rag
    kind: graph
    graph:
      nodes:
        root:
          type: sequence
          steps:
            - {{model: minilm, name: vec, input: {{input: "$request.messages[-1].content"}}}}
            - model: tiny
              input:
                max_tokens: 6
                temperature: 0.0
                messages:
                  - {{role: system, content: "Context: {{$steps.vec.data[0].embedding[0]}}"}}
                  - "$request.messages[-1]"
  - name: route
    kind: graph
    graph:
      nodes:
        root:
          type: switch
          steps:
            - {{model: classifier, name: short, when: "$request.instances[0].text =~ ^a",
               input: {{instances: [{{text: short}}]}}}}
            - {{model: classifier, name: long, input: {{instances: [{{text: longer}}]}}}}
  - name: both
    kind: graph
    graph:
      nodes:
        root:
          type: ensemble
          steps:
            - {{model: classifier}}
            - {{model: minilm, input: {{input: "$request.instances[0].text"}}}}
  - name: ab
    kind: graph
    graph:
      nodes:
        root:
          type: splitter
          seed: 1
          steps:
            - {{model: classifier, name: a, weight: 1}}
            - {{model: classifier, name: b, weight: 1}}
  - name: tell
    kind: graph
    graph:
      nodes:
        root:
          type: sequence
          steps:
            - {{model: classifier}}
            - {{model: tiny, input: {{prompt: "Label: {{$steps.classifier.predictions[0].label}}",
                                     max_tokens: 5, temperature: 0.0}}}}
  - name: slow
    kind: graph
    graph:
      timeout_s: 1.0
      nodes:
        root:
          type: sequence
          steps:
            - {{model: tiny, input: {{prompt: "The sea", max_tokens: 400, ignore_eos: true}}}}
            - {{model: classifier, input: {{instances: [{{text: x}}]}}}}
classes:
  interactive: {{priority: 0}}
  batch: {{priority: 10}}
default_class: interactive
"""
# Every engine step takes at least this long, so a long sub-call or graph step is still
# running when its parent's timeout, deadline or client ends it (the tiny models alone
# finish in a blink): 400 tokens run 8+ s.
PIPELINE_STEP_DELAY_S = "0.02"
