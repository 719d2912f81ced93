"""Structured outputs on llguidance: request constraints -> grammars (grammars.py), the
engine core's per-request matchers (backend.py) and each step's token masks
(step_masks.py). The core sees only core/structured.py's interfaces."""
