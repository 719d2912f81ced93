"""fleetserve's BERT encoder against HF transformers' BertModel on tiny random checkpoints."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fleetserve.models.bert import BertConfig, BertModel


def _hf_checkpoint(tmp_path: Path, hidden_act: str) -> tuple[str, torch.nn.Module]:
    from transformers import BertConfig as HFBertConfig
    from transformers import BertModel as HFBertModel

    torch.manual_seed(0)
    cfg = HFBertConfig(
        vocab_size=101,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=40,
        hidden_act=hidden_act,
    )
    hf = HFBertModel(cfg).eval()
    hf.save_pretrained(tmp_path, safe_serialization=True)
    return str(tmp_path), hf


@pytest.mark.parametrize("hidden_act", ["gelu", "gelu_new"])
def test_last_hidden_state_matches_transformers_on_a_ragged_batch(
    tmp_path: Path, hidden_act: str
) -> None:
    folder, hf = _hf_checkpoint(tmp_path, hidden_act)
    ours = BertModel.from_folder(folder)
    lengths = [7, 1, 40, 13]
    ids = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
    mask = torch.zeros_like(ids)
    gen = torch.Generator().manual_seed(1)
    for row, n in enumerate(lengths):
        ids[row, :n] = torch.randint(1, 101, (n,), generator=gen)
        mask[row, :n] = 1
    with torch.inference_mode():
        got = ours(ids, mask)
        want = hf(input_ids=ids, attention_mask=mask).last_hidden_state
        for row, n in enumerate(lengths):
            torch.testing.assert_close(got[row, :n], want[row, :n], atol=1e-5, rtol=1e-4)
            # The same input alone: padding must not reach the real tokens.
            alone = ours(ids[row : row + 1, :n], mask[row : row + 1, :n])
            torch.testing.assert_close(alone[0], got[row, :n], atol=1e-5, rtol=1e-4)
            assert not got[row, n:].any()  # padding positions stay zero


def test_too_long_input_and_unsupported_configs_are_refused(tmp_path: Path) -> None:
    folder, _ = _hf_checkpoint(tmp_path, "gelu")
    model = BertModel.from_folder(folder)
    ids = torch.ones(1, 41, dtype=torch.long)
    with pytest.raises(ValueError, match="max_position_embeddings 40"):
        model(ids, torch.ones_like(ids))
    base = {"model_type": "bert", "hidden_size": 32, "num_attention_heads": 4}
    with pytest.raises(ValueError, match="model_type must be 'bert'"):
        BertConfig.from_hf({**base, "model_type": "roberta"})
    with pytest.raises(ValueError, match="position_embedding_type"):
        BertConfig.from_hf({**base, "position_embedding_type": "relative_key"})
    with pytest.raises(ValueError, match="hidden_act"):
        BertConfig.from_hf({**base, "hidden_act": "relu"})
