"""Which proposer an engine's speculative config asks for."""

from __future__ import annotations

from fleetserve.config import EngineConfig
from fleetserve.spec_decode.base import Proposer
from fleetserve.spec_decode.ngram import NgramProposer


def make_proposer(config: EngineConfig, num_blocks: int) -> Proposer:
    spec = config.speculative
    assert spec is not None
    if spec.method == "ngram":
        return NgramProposer(spec)
    from fleetserve.spec_decode.draft_model import DraftModelProposer

    return DraftModelProposer(config, num_blocks)
