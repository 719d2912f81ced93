"""The operations tests' fleet (access log, dashboard): its file and API key."""

# A fleet of two generate models behind an API key, for the access-log and dashboard
# tests. `chat-a` has two replicas (a spot and an on-demand pool) so a request can move.
OPS_FLEET = """
models:
  - name: chat-a
    model: {llama}
    engine: {{max_num_seqs: 4, num_threads: 1, max_model_len: 256}}
    pools:
      - {{name: spot, capacity: spot, replicas: 1}}
      - {{name: base, capacity: on_demand, replicas: 1}}
  - name: chat-b
    model: {qwen2}
    engine: {{max_num_seqs: 4, num_threads: 1, max_model_len: 256}}
classes:
  interactive: {{priority: 0}}
  batch: {{priority: 10}}
default_class: interactive
"""
OPS_API_KEY = "ops-test-key"
# Every engine step takes at least this long, so a stream is still running when its
# replica is drained (the tiny models alone finish in a blink).
OPS_STEP_DELAY_S = "0.02"
