"""Tests for models/: classifiers, flat parameter vectors, ConvAE and its ONNX encoder."""

from __future__ import annotations

import gzip
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from flt.models.autoencoder import ConvAE, export_encoder_onnx, onnx_embed, onnx_session
from flt.models.flat import flatten, load_flat, model_bytes, param_spec, unflatten
from flt.models.nets import MODEL_NAMES, build_model

MNIST_DIR = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "mnist"

SHAPES = {
    "mnist": ((1, 28, 28), 10),
    "femnist": ((1, 28, 28), 62),
    "cifar": ((3, 32, 32), 10),
}


# ---------------------------------------------------------------- nets


@pytest.mark.parametrize("name", MODEL_NAMES)
@pytest.mark.parametrize("ds", list(SHAPES))
def test_output_shapes(name, ds):
    in_shape, k = SHAPES[ds]
    torch.manual_seed(0)
    m = build_model(name, in_shape, k)
    out = m(torch.rand(5, *in_shape))
    assert out.shape == (5, k)


def test_mlp_param_count():
    m = build_model("mlp", (1, 28, 28), 10)
    assert sum(p.numel() for p in m.parameters()) == 784 * 200 + 200 + 200 * 10 + 10 == 159010
    assert param_spec(m).total == 159010
    assert model_bytes(m) == 4 * 159010


def test_leaf_and_cifar_sizes():
    leaf = build_model("leaf_cnn", (1, 28, 28), 62)
    assert leaf[7].in_features == 64 * 7 * 7
    cifar = build_model("cifar_cnn", (3, 32, 32), 10)
    assert cifar[7].in_features == 400
    # flatten size derived from in_shape, not hard-coded
    assert build_model("cifar_cnn", (1, 28, 28), 10)[7].in_features == 16 * 4 * 4


def test_no_batchnorm():
    for name in MODEL_NAMES:
        m = build_model(name, (3, 32, 32), 10)
        assert not any(isinstance(x, torch.nn.modules.batchnorm._BatchNorm) for x in m.modules())
        assert len(list(m.buffers())) == 0


def test_unknown_model():
    with pytest.raises(ValueError, match=r"mlp.*leaf_cnn.*cifar_cnn"):
        build_model("resnet", (1, 28, 28), 10)


# ---------------------------------------------------------------- flat


def test_flatten_roundtrip():
    torch.manual_seed(0)
    m = build_model("leaf_cnn", (1, 28, 28), 62)
    vec = flatten(m)
    spec = param_spec(m)
    assert vec.dtype == torch.float32 and vec.dim() == 1 and vec.is_contiguous()
    assert not vec.requires_grad and vec.device.type == "cpu"
    assert vec.numel() == spec.total
    assert spec.names == tuple(n for n, _ in m.named_parameters())
    d = unflatten(vec, spec)
    assert list(d) == list(spec.names)
    for n, p in m.named_parameters():
        assert torch.equal(d[n], p.detach())
        assert d[n].data_ptr() >= vec.data_ptr()  # a view, not a copy
    # flatten returns a copy: mutating it leaves the module alone
    vec.zero_()
    assert any(p.abs().sum() > 0 for p in m.parameters())


def test_unflatten_batch_views():
    m = build_model("cifar_cnn", (3, 32, 32), 10)
    spec = param_spec(m)
    B = 3
    stack = torch.randn(B, spec.total)
    d = unflatten(stack, spec)
    for n, shape in zip(spec.names, spec.shapes, strict=True):
        assert d[n].shape == (B, *shape)
        assert d[n]._base is stack  # view into the stack
    # each row of the batch matches unflatten of that row
    for b in range(B):
        row = unflatten(stack[b], spec)
        for n in spec.names:
            assert torch.equal(d[n][b], row[n])
    # writes through the view reach the stack
    d[spec.names[0]][1].fill_(7.0)
    assert torch.all(stack[1, : spec.numel[0]] == 7.0)
    with pytest.raises(ValueError):
        unflatten(torch.zeros(spec.total + 1), spec)


def test_load_flat_changes_outputs():
    torch.manual_seed(0)
    a = build_model("mlp", (1, 28, 28), 10).eval()
    b = build_model("mlp", (1, 28, 28), 10).eval()
    x = torch.rand(4, 1, 28, 28)
    assert not torch.allclose(a(x), b(x))
    load_flat(b, flatten(a))
    torch.testing.assert_close(a(x), b(x), rtol=0, atol=0)
    assert torch.equal(flatten(a), flatten(b))
    load_flat(b, torch.zeros(param_spec(b).total))
    assert torch.equal(b(x), torch.zeros(4, 10))


@pytest.mark.parametrize("name", ["mlp", "leaf_cnn"])
def test_vmap_functional_call_matches_separate_modules(name):
    torch.manual_seed(0)
    in_shape, k = (1, 28, 28), 62
    B = 3
    mods = [build_model(name, in_shape, k).eval() for _ in range(B)]  # eval: dropout off
    spec = param_spec(mods[0])
    stack = torch.stack([flatten(m) for m in mods])  # [B, total]
    x = torch.rand(B, 4, *in_shape)  # per-client batch
    base = mods[0]

    def f(params, xb):
        return torch.func.functional_call(base, params, (xb,))

    out = torch.func.vmap(f)(unflatten(stack, spec), x)
    ref = torch.stack([m(x[i]) for i, m in enumerate(mods)])
    assert out.shape == (B, 4, k)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)

    # gradients w.r.t. the flat stack also work (what the trainer differentiates)
    stack.requires_grad_(True)
    out = torch.func.vmap(f)(unflatten(stack, spec), x)
    out.sum().backward()
    assert stack.grad is not None and stack.grad.shape == stack.shape


# ---------------------------------------------------------------- ConvAE


@pytest.mark.parametrize("in_shape", [(1, 28, 28), (3, 32, 32), (3, 10, 14), (1, 30, 30), (3, 3, 3), (1, 1, 1)])
def test_convae_shapes(in_shape):
    torch.manual_seed(0)
    ae = ConvAE(in_shape)
    x = torch.rand(6, *in_shape)
    z = ae.encode(x)
    r = ae(x)
    assert z.shape == (6, 128)
    assert r.shape == x.shape
    assert r.min() >= 0 and r.max() <= 1


def test_convae_paper_sizes():
    ae = ConvAE((1, 28, 28))
    assert ae.encoder[-1].in_features == 196 and ae.encoder[-1].out_features == 128
    assert not any(isinstance(x, torch.nn.modules.batchnorm._BatchNorm) for x in ae.modules())
    assert not any(isinstance(x, torch.nn.ZeroPad2d) for x in ae.modules())  # the paper's network, unpadded
    odd = ConvAE((1, 30, 30))  # padded to 32 x 32: an 8 x 8 bottleneck
    assert isinstance(odd.encoder[0], torch.nn.ZeroPad2d) and odd.encoder[-1].in_features == 4 * 8 * 8


def test_onnx_parity_for_an_image_size_that_needs_padding():
    """An image folder of 10 x 14 pictures was a traceback ("divisible by 4") after the
    FedAvg rows had run; the padded encoder exports and matches torch in onnxruntime."""
    torch.manual_seed(0)
    ae = ConvAE((3, 10, 14))
    sess = onnx_session(export_encoder_onnx(ae, (3, 10, 14)))
    x = np.random.default_rng(0).random((9, 3, 10, 14), dtype=np.float32)
    _assert_parity(ae, sess, x, batch=4)


def test_convae_wider_bottleneck_travels_both_ways():
    """`encoder.channels` widens the bottleneck; the ONNX encoder (Enc1) and the weights a
    device rebuilds from the encoder message's meta (Enc2) must follow it, or a device
    would load a 16-channel vector into the paper's 4-channel model."""
    from flt.devices.embedding import embed_finetuned

    torch.manual_seed(0)
    ae = ConvAE((3, 32, 32), 128, channels=16)
    assert ae.encoder[3].out_channels == 16 and ae.encoder[-1].in_features == 16 * 8 * 8
    assert ae.decoder[3].in_channels == 16
    x = torch.rand(5, 3, 32, 32)
    assert ae(x).shape == x.shape
    sess = onnx_session(export_encoder_onnx(ae, (3, 32, 32)))
    np.testing.assert_allclose(onnx_embed(sess, x.numpy()), ae.encode(x).detach().numpy(), atol=1e-4)
    finetune = {"epochs": 1, "lr": 1e-3, "batch_size": 4}
    meta = {"in_shape": [3, 32, 32], "latent": 128, "channels": 16, "finetune": finetune}
    (z,) = embed_finetuned(flatten(ae).numpy(), meta, [x], [torch.Generator().manual_seed(0)])
    assert z.shape == (5, 128)
    with pytest.raises(ValueError, match="expected last dim"):  # the paper's width cannot hold them
        embed_finetuned(flatten(ae).numpy(), {**meta, "channels": 4}, [x], [torch.Generator().manual_seed(0)])


def _digits_28() -> np.ndarray:
    from sklearn.datasets import load_digits

    x = load_digits().images.astype(np.float32) / 16.0  # [1797, 8, 8] in [0, 1]
    t = torch.from_numpy(x)[:, None]
    t = F.interpolate(t, size=(28, 28), mode="bilinear", align_corners=False)
    return t.clamp(0, 1).numpy()


def _mnist_images(n: int) -> np.ndarray:
    with gzip.open(MNIST_DIR / "train-images-idx3-ubyte.gz", "rb") as fh:
        raw = fh.read()
    assert int.from_bytes(raw[:4], "big") == 2051  # IDX magic for uint8 3-D images
    count, rows, cols = (int.from_bytes(raw[i : i + 4], "big") for i in (4, 8, 12))
    imgs = np.frombuffer(raw, dtype=np.uint8, offset=16).reshape(count, rows, cols)
    return (imgs[:n].astype(np.float32) / 255.0)[:, None]


@pytest.fixture(scope="module")
def exported():
    torch.manual_seed(0)
    ae = ConvAE((1, 28, 28))
    ae.train()
    data = export_encoder_onnx(ae, (1, 28, 28))
    return ae, data


def _assert_parity(ae, sess, x, batch=1024):
    got = onnx_embed(sess, x, batch=batch)
    with torch.no_grad():
        ref = ae.eval().encode(torch.from_numpy(x)).numpy()
    assert got.shape == (len(x), 128) and got.dtype == np.float32
    np.testing.assert_allclose(got, ref, atol=1e-4, rtol=0)


def test_onnx_export_self_contained(exported):
    import onnx

    ae, data = exported
    assert isinstance(data, bytes)
    assert ae.training  # export restored the caller's mode
    model = onnx.load_model_from_string(data)
    assert [i.name for i in model.graph.input] == ["images"]
    assert [o.name for o in model.graph.output] == ["embedding"]
    dim0 = model.graph.input[0].type.tensor_type.shape.dim[0]
    assert dim0.dim_param and not dim0.dim_value  # dynamic batch
    assert all(t.data_location != onnx.TensorProto.EXTERNAL for t in model.graph.initializer)


def test_onnx_parity_digits(exported):
    ae, data = exported
    sess = onnx_session(data)
    x = _digits_28()
    _assert_parity(ae, sess, x)  # 1797 images -> two chunks of 1024/773
    _assert_parity(ae, sess, x[:37], batch=5)  # batch sizes != export's 2, incl. a ragged last chunk
    _assert_parity(ae, sess, x[:1])


def test_onnx_parity_mnist(exported):
    if not (MNIST_DIR / "train-images-idx3-ubyte.gz").exists():
        pytest.skip(f"real MNIST not found at {MNIST_DIR}/train-images-idx3-ubyte.gz")
    ae, data = exported
    sess = onnx_session(data, intra_op_num_threads=2)
    x = _mnist_images(256)
    assert x.shape == (256, 1, 28, 28) and x.min() >= 0 and x.max() <= 1 and x.max() > 0.9
    _assert_parity(ae, sess, x)
    _assert_parity(ae, sess, x, batch=100)


def test_onnx_parity_cifar_shape():
    torch.manual_seed(0)
    ae = ConvAE((3, 32, 32))
    sess = onnx_session(export_encoder_onnx(ae, (3, 32, 32)))
    x = np.random.default_rng(0).random((9, 3, 32, 32), dtype=np.float32)
    _assert_parity(ae, sess, x, batch=4)


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_signed_inputs_feed_the_same_weights_2x_minus_1(name):
    """train.inputs: signed (the FLT authors' CIFAR-10 Normalize(0.5, 0.5)) adds no weight:
    the flat vector is the same, and the model sees 2x - 1 where unit sees x."""
    shape = (3, 32, 32) if name == "cifar_cnn" else (1, 28, 28)
    torch.manual_seed(0)
    unit = build_model(name, shape, 10)
    signed = build_model(name, shape, 10, inputs="signed")
    assert param_spec(signed) == param_spec(unit)
    load_flat(signed, flatten(unit))
    x = torch.rand(4, *shape)
    unit.eval(), signed.eval()
    assert torch.equal(signed(x), unit(x * 2 - 1))
    assert not torch.equal(signed(x), unit(x))
    with pytest.raises(ValueError, match="unknown inputs 'centred'"):
        build_model(name, shape, 10, inputs="centred")


def test_the_initial_weights_spec_names_signed_inputs_only_when_asked():
    """Devices build their model from this spec; a default run's spec (and so its assign
    messages) is what it was before train.inputs existed."""
    from types import SimpleNamespace

    from flt.emulator.run import initial_weights

    train = SimpleNamespace(x=np.zeros((2, 3, 32, 32), np.uint8), num_classes=10)
    for inputs, expect in (("unit", None), ("signed", "signed")):
        cfg = {"seed": 0, "model": "cifar_cnn", "train": {"inputs": inputs}}
        init, spec = initial_weights(cfg, train)
        assert spec.get("inputs") == expect
        assert init.numel() == sum(param_spec(build_model("cifar_cnn", (3, 32, 32), 10)).numel)
