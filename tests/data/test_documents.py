"""Document boundaries from the EOD id: positions, document ids and loss mask with Megatron-LM's meaning."""

import torch

from megatron_lev.config import load_config
from megatron_lev.data.boundaries import DocumentLayout, document_positions

EOD = 0


def _stream(lengths, rows, seq, seed=0):
    g = torch.Generator().manual_seed(seed)
    stream = torch.cat(
        [torch.cat([torch.randint(1, 200, (n,), generator=g), torch.tensor([EOD])]) for n in lengths]
    )
    return stream[: rows * seq].view(rows, seq)


def test_positions_and_documents_restart_after_each_eod():
    ids = torch.tensor([[5, 6, EOD, 7, 8, EOD, 9], [EOD, EOD, 1, 2, 3, 4, EOD]])
    positions, docs = document_positions(ids, EOD)
    assert positions.tolist() == [[0, 1, 2, 0, 1, 2, 0], [0, 0, 0, 1, 2, 3, 4]]
    assert docs.tolist() == [[0, 0, 0, 1, 1, 1, 2], [0, 1, 2, 2, 2, 2, 2]]
    # the reference loop: an EOD belongs to the document it ends; the token after it is at position 0
    ids = _stream((3, 0, 0, 20, 2, 11, 1, 30), rows=3, seq=24)
    positions, docs = document_positions(ids, EOD)
    for r in range(ids.shape[0]):
        pos = doc = 0
        for t in range(ids.shape[1]):
            assert (positions[r, t], docs[r, t]) == (pos, doc)
            pos, doc = (0, doc + 1) if ids[r, t] == EOD else (pos + 1, doc)


def test_layout_is_off_by_default_and_each_key_adds_one_tensor():
    assert DocumentLayout.from_config(load_config(None, []).data, EOD) is None
    ids = _stream((4, 9, 2, 30), rows=2, seq=16)
    for key, present in (
        ("reset_position_ids", "position_ids"),
        ("reset_attention_mask", "document_ids"),
        ("eod_mask_loss", "loss_mask"),
    ):
        layout = DocumentLayout.from_config(load_config(None, [f"data.{key}=true"]).data, EOD)
        assert layout.eod == EOD
        out = layout(ids)
        assert [k for k, v in out.items() if v is not None] == [present]
    mask = DocumentLayout(EOD, eod_mask_loss=True)(ids)["loss_mask"]
    assert mask.dtype == torch.float32 and torch.equal(mask == 0, ids == EOD)  # where the input is EOD
