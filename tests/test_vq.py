"""The VQ tokenizer: official VQ-16 state-dict layout, token order, decode paths, training forward."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from runtime.models.configs import VQ_CONFIGS
from runtime.models.vq import VQModel


def official_vq16_layout() -> dict[str, tuple[int, ...]]:
    """Keys and shapes of LlamaGen's `VQ_16()` state dict, written out from the reference layout
    (tokenizer/tokenizer_image/vq_model.py), independently of our module code."""
    layout: dict[str, tuple[int, ...]] = {}

    def conv(name: str, c_out: int, c_in: int, k: int) -> None:
        layout[f"{name}.weight"] = (c_out, c_in, k, k)
        layout[f"{name}.bias"] = (c_out,)

    def norm(name: str, c: int) -> None:
        layout[f"{name}.weight"] = (c,)
        layout[f"{name}.bias"] = (c,)

    def res(name: str, c_in: int, c_out: int) -> None:
        norm(f"{name}.norm1", c_in)
        conv(f"{name}.conv1", c_out, c_in, 3)
        norm(f"{name}.norm2", c_out)
        conv(f"{name}.conv2", c_out, c_out, 3)
        if c_in != c_out:
            conv(f"{name}.nin_shortcut", c_out, c_in, 1)

    def attn(name: str, c: int) -> None:
        norm(f"{name}.norm", c)
        for part in ("q", "k", "v", "proj_out"):
            conv(f"{name}.{part}", c, c, 1)

    def mid(prefix: str, c: int) -> None:
        res(f"{prefix}.mid.0", c, c)
        attn(f"{prefix}.mid.1", c)
        res(f"{prefix}.mid.2", c, c)

    enc_channels = [128, 128, 256, 256, 512]
    conv("encoder.conv_in", 128, 3, 3)
    c_in = 128
    for level, c in enumerate(enc_channels):
        for i in range(2):
            res(f"encoder.conv_blocks.{level}.res.{i}", c_in if i == 0 else c, c)
            if level == 4:
                attn(f"encoder.conv_blocks.{level}.attn.{i}", c)
        if level < 4:
            conv(f"encoder.conv_blocks.{level}.downsample.conv", c, c, 3)
        c_in = c
    mid("encoder", 512)
    norm("encoder.norm_out", 512)
    conv("encoder.conv_out", 256, 512, 3)

    conv("quant_conv", 8, 256, 1)
    layout["quantize.embedding.weight"] = (16384, 8)
    layout["quantize.codebook_used"] = (65536,)
    conv("post_quant_conv", 256, 8, 1)

    conv("decoder.conv_in", 512, 256, 3)
    mid("decoder", 512)
    c_in = 512
    for block, c in enumerate([512, 256, 256, 128, 128]):
        for i in range(3):
            res(f"decoder.conv_blocks.{block}.res.{i}", c_in if i == 0 else c, c)
            if block == 0:
                attn(f"decoder.conv_blocks.{block}.attn.{i}", c)
        if block < 4:
            conv(f"decoder.conv_blocks.{block}.upsample.conv", c, c, 3)
        c_in = c
    norm("decoder.norm_out", 128)
    conv("decoder.conv_out", 3, 128, 3)
    return layout


def test_vq16_state_dict_equals_official_layout():
    with torch.device("meta"):
        model = VQModel(VQ_CONFIGS["VQ-16"])
    got = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    want = official_vq16_layout()
    assert sorted(got) == sorted(want)
    assert got == want
    assert len(got) == 344
    # spot checks straight from the reference text
    assert got["quant_conv.weight"] == (8, 256, 1, 1)
    assert got["encoder.conv_blocks.4.attn.0.q.weight"] == (512, 512, 1, 1)
    assert got["decoder.conv_blocks.0.attn.2.proj_out.weight"] == (512, 512, 1, 1)
    n_params = sum(p.numel() for p in model.parameters())
    assert f"{n_params / 1e6:.1f}M" == "71.9M"


def test_vq16_without_usage_buffer_drops_only_that_key():
    from dataclasses import replace

    with torch.device("meta"):
        model = VQModel(replace(VQ_CONFIGS["VQ-16"], codebook_show_usage=False))
    assert set(official_vq16_layout()) - set(model.state_dict()) == {"quantize.codebook_used"}


@pytest.fixture
def tiny_vq(tiny_vq_config) -> VQModel:
    torch.manual_seed(0)
    return VQModel(tiny_vq_config).eval()


def test_tiny_vq_encode_decode_shapes(tiny_vq):
    x = torch.rand(2, 3, 64, 32) * 2 - 1
    with torch.no_grad():
        quant, tokens = tiny_vq.encode(x)
        image = tiny_vq.decode(quant)
    assert quant.shape == (2, 8, 4, 2)
    assert tokens.shape == (2, 8) and tokens.dtype == torch.long
    assert int(tokens.min()) >= 0 and int(tokens.max()) < 512
    assert image.shape == (2, 3, 64, 32)
    assert tiny_vq.downsample == 16


def test_tokens_are_raster_order_and_quant_is_their_normalised_codebook_rows(tiny_vq):
    x = torch.rand(2, 3, 64, 32) * 2 - 1
    with torch.no_grad():
        quant, tokens = tiny_vq.encode(x)
    codebook = tiny_vq.codebook_vectors(normalized=True)
    h, w = quant.shape[2:]
    for r in range(h):
        for c in range(w):
            assert torch.equal(quant[:, :, r, c], codebook[tokens[:, r * w + c]])


def test_decode_code_equals_decode_of_the_same_codes(tiny_vq):
    x = torch.rand(2, 3, 64, 64) * 2 - 1
    with torch.no_grad():
        quant, tokens = tiny_vq.encode(x)
        from_quant = tiny_vq.decode(quant)
        square = tiny_vq.decode_code(tokens)  # (B, h*w): square grid inferred
        grid = tiny_vq.decode_code(tokens.view(2, 4, 4))
        qzshape = tiny_vq.decode_code(tokens.reshape(-1), shape=(2, 8, 4, 4))  # LlamaGen's call
    assert torch.equal(square, from_quant)
    assert torch.equal(grid, square)
    assert torch.equal(qzshape, square)


def test_decode_code_rejects_a_non_square_flat_grid_without_shape(tiny_vq):
    with pytest.raises(ValueError, match="pass shape"):
        tiny_vq.decode_code(torch.zeros(1, 8, dtype=torch.long))


def test_quantizer_is_scale_invariant_with_l2_norm(tiny_vq):
    """With an l2-normalised codebook, scaling the encoder output never changes the codes."""
    z = torch.randn(2, 8, 3, 3)
    with torch.no_grad():
        _, _, idx = tiny_vq.quantize(z)
        _, _, idx_scaled = tiny_vq.quantize(z * 7.5)
    assert torch.equal(idx, idx_scaled)


def test_quantizer_picks_the_code_with_the_largest_cosine(tiny_vq):
    z = torch.randn(1, 8, 4, 4)
    with torch.no_grad():
        _, _, idx = tiny_vq.quantize(z)
    flat = F.normalize(z.permute(0, 2, 3, 1).reshape(-1, 8), dim=-1)
    cosine = flat @ tiny_vq.codebook_vectors(normalized=True).T
    assert torch.equal(idx, cosine.argmax(dim=1))


def test_codebook_vectors_raw_and_normalised(tiny_vq):
    with torch.no_grad():
        tiny_vq.quantize.embedding.weight.mul_(3.0)  # raw rows are stored un-normalised
    raw = tiny_vq.codebook_vectors(normalized=False)
    normed = tiny_vq.codebook_vectors(normalized=True)
    assert raw.shape == normed.shape == (512, 8)
    assert torch.equal(raw, tiny_vq.quantize.embedding.weight)
    torch.testing.assert_close(normed.norm(dim=1), torch.ones(512))
    torch.testing.assert_close(normed, F.normalize(raw, dim=1))
    assert not raw.requires_grad and not normed.requires_grad


def test_training_forward_returns_recon_and_losses_and_trains(tiny_vq_config):
    torch.manual_seed(0)
    model = VQModel(tiny_vq_config).train()
    x = torch.rand(2, 3, 32, 32) * 2 - 1
    recon, (vq_loss, commit_loss, entropy, usage) = model(x)
    assert recon.shape == x.shape
    assert vq_loss.ndim == 0 and commit_loss.ndim == 0 and entropy.ndim == 0
    torch.testing.assert_close(commit_loss, 0.25 * vq_loss)  # same distance, beta = 0.25
    loss = F.mse_loss(recon, x) + vq_loss + commit_loss + entropy
    loss.backward()
    assert model.encoder.conv_in.weight.grad is not None  # straight-through estimator
    assert model.quantize.embedding.weight.grad is not None

    # the 2x(2x2) codes just used sit at the end of the usage ring buffer (zeros before them)
    with torch.no_grad():
        _, tokens = model.eval().encode(x)
    used = model.quantize.codebook_used
    assert torch.equal(used[-8:], tokens.flatten().float())
    assert usage == len(torch.unique(used)) / 512


def test_eval_forward_has_no_losses(tiny_vq):
    with torch.no_grad():
        recon, (vq_loss, commit_loss, entropy, usage) = tiny_vq(torch.zeros(1, 3, 32, 32))
    assert recon.shape == (1, 3, 32, 32)
    assert vq_loss is None and commit_loss is None and entropy is None and usage == 0.0
