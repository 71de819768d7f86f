"""A quantized self-draft on its target's own 4-bit code panels (kernels/native_shared.py): the same
bits as native4i8 on a copy of those codes, for every row count and both code orders (float32's
`codes4`, bfloat16's `pair_codes4`); the default model's int4 draft shares its target's layers."""

import pytest
import torch

from selfspec.decoding.round import SpecConfig
from selfspec.kernels import NativeCodes, native
from selfspec.kernels.native_dot import NativeInt4Dot, pack
from selfspec.kernels.native_shared import SharedCodes

from .test_codes import DTYPES, dequantized

pytestmark = pytest.mark.skipif(
    native.library() is None or not native.library().shared_codes,
    reason="linear_q4_codes_i8 needs native.c built with AVX512-VBMI",
)


def codes_of(target: NativeCodes) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The target's codes back out of its panels: q [out, G, 32] uint8 and d, m [out, G] float32."""
    p, groups = target.panels.shape[:2]
    head, body = target.panels[..., :64], target.panels[..., 64:]
    d, m = head.contiguous().view(torch.float16).float().view(p, groups, 2, 16).unbind(2)  # [P, G, 16]
    b = body.reshape(p, groups, 16, 16)
    q = torch.stack([b & 15, b >> 4], 3).view(p, groups, 32, 16)  # row 2t + h, lane
    if target.layout == "pair_codes4":  # lane 2c + e of row 2t + h -> input 2t + e, column 8h + c
        q = q.view(p, groups, 16, 2, 8, 2).permute(0, 1, 2, 5, 3, 4).reshape(q.shape)
    columns = lambda t: t.transpose(1, 2).reshape(p * 16, groups)  # noqa: E731  [P, G, 16] -> [out, G]
    return q.permute(0, 3, 1, 2).reshape(p * 16, groups, 32), columns(d), columns(m)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["Q4_1", "Q4_0"])
def test_the_draft_on_the_targets_codes_has_native4i8s_bits(kind, dtype):
    w = dequantized(kind, out=80, inn=192)
    target = NativeCodes(w, None, dtype)
    shared = SharedCodes.of(target, dtype)
    assert shared is not None and shared.panels.data_ptr() == target.panels.data_ptr() and shared.nbytes == 0
    q, d, m = codes_of(target)
    assert torch.equal((q * d[..., None] + m[..., None]).view(len(q), -1)[: w.shape[0]], w)  # the codes read back
    own = NativeInt4Dot(w, None, dtype)  # its own panels, then the target's codes in native4i8's layout
    own.panels = pack((q[..., :16] | q[..., 16:] << 4).to(torch.uint8)[: w.shape[0]], d[: w.shape[0]], m[: w.shape[0]])
    x = torch.randn(20, w.shape[1], generator=torch.Generator().manual_seed(1))
    for rows in (1, 2, 3, 5, 8, 9, 20):
        assert torch.equal(shared.matmul_float32(x[:rows]), own.matmul_float32(x[:rows])), rows
    assert not torch.equal(shared.matmul_float32(x[:1]), shared.matmul_float32(x[1:2]))  # the rows differ


def test_a_target_without_codes_keeps_the_drafts_own_panels():
    from selfspec.kernels import NativeFloat

    w = torch.randn(32, 64)
    assert SharedCodes.of(NativeFloat(w, None, torch.float32), torch.float32) is None
    assert SharedCodes.of(NativeCodes(w, None, torch.float32), torch.float32) is None  # float panels, no codes


def test_the_default_models_int4_draft_shares_its_targets_layers(default_engine):
    """The default model (a 4-bit GGUF on `codes`): every layer linear of its int4 draft reads the target's
    panels, so the copy adds only its shortlisted head (test_speculative_default checks its drafts
    verify to plain decoding's tokens)."""
    target = default_engine.model
    if not all(lin.layout in ("codes4", "pair_codes4") for layer in target.layers for lin in layer.linears()):
        pytest.skip(f"the default model's linears are not all 4-bit codes here ({target.kernels.backend})")
    drafter = default_engine.drafter(SpecConfig(None, 4, "int4"))
    for mine, theirs in zip(drafter.draft.layers, target.layers):
        for a, b in zip(mine.linears(), theirs.linears()):
            assert isinstance(a, SharedCodes) and a.panels.data_ptr() == b.panels.data_ptr()
    head = drafter.draft.head.coarse.nbytes
    assert drafter.memory_bytes == head and drafter.describe()["memory_mb"] == round(head / 2**20, 1)
