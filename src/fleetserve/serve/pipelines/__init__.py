"""Models that call models: cascades (a small tier first, a larger one when a rule says so).

cascade_config.py is the fleet file's `kind: cascade` keys, rules.py the escalation rules,
cascade.py the CascadeService built from the tiers' own services (a sub-call is an ordinary
admission to the tier's GenerateService, never HTTP to ourselves)."""
