"""The paper's convolutional autoencoder (FLT's ConvAE) and its ONNX encoder.

Clients embed their local data with the encoder only; it ships as ONNX so edge
devices need onnxruntime, not torch.
"""

from __future__ import annotations

import io
import warnings
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn

if TYPE_CHECKING:  # onnxruntime is imported where a session is built, not with the model
    from onnxruntime import InferenceSession


PAPER_CHANNELS = 4  # the paper's ConvAE: 4 x 7 x 7 = 196 values for a 28x28 grey image
COLOUR_CHANNELS = 32  # encoder.channels' 'auto' for colour images (bottleneck_channels)


def bottleneck_channels(setting: int | str, in_channels: int) -> int:
    """The ConvAE's bottleneck width for `encoder.channels`: 'auto' keeps the paper's 4 for
    grey images and takes 32 for colour ones, where 4 channels keep a twelfth of a 32x32
    image's values and CIFAR-10's animal groups do not separate (32: the narrowest width
    measured that found the planted groups in every separable CIFAR-10 case of the FCR
    quality suite, benchmarks/README.md)."""
    if setting == "auto":
        return PAPER_CHANNELS if in_channels == 1 else COLOUR_CHANNELS
    return int(setting)


class ConvAE(nn.Module):
    """ConvAE: 28x28 input -> 4*7*7 = 196 -> ``latent`` (128) as in the paper.

    ``channels`` is the bottleneck's width (the second conv's output): the paper's 4 keeps
    a quarter of a 28x28 grey image's values, a twelfth of a 32x32 colour image's.
    Two 2x poolings need H and W divisible by 4: other sizes (an image folder of 10 x 14
    pictures) are padded with zeros on the bottom and right to the next multiple of 4 on
    the way in, and the reconstruction is cropped back. 28 x 28 and 32 x 32 need neither,
    so their networks (and ONNX bytes) are the paper's.
    """

    def __init__(self, in_shape: tuple[int, int, int] = (1, 28, 28), latent: int = 128, channels: int = PAPER_CHANNELS):
        super().__init__()
        c, h, w = (int(s) for s in in_shape)
        if min(c, h, w) < 1:
            raise ValueError(f"ConvAE needs images of at least 1 x 1 pixel, got {in_shape}")
        self.in_shape = (c, h, w)
        self.latent = int(latent)
        self.channels = int(channels)
        ph, pw = -h % 4, -w % 4
        pad: list[nn.Module] = [nn.ZeroPad2d((0, pw, 0, ph))] if ph or pw else []
        crop: list[nn.Module] = [_Crop(h, w)] if ph or pw else []
        bottleneck = (self.channels, (h + ph) // 4, (w + pw) // 4)
        d = self.channels * bottleneck[1] * bottleneck[2]
        self.encoder = nn.Sequential(
            *pad,
            nn.Conv2d(c, 16, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(16, self.channels, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Flatten(),
            nn.Linear(d, self.latent),
        )
        self.decoder = nn.Sequential(
            nn.Linear(self.latent, d),
            nn.ReLU(),
            nn.Unflatten(1, bottleneck),
            nn.ConvTranspose2d(self.channels, 16, 2, stride=2),
            nn.ReLU(),
            nn.ConvTranspose2d(16, c, 2, stride=2),
            *crop,
            nn.Sigmoid(),  # inputs are scaled to [0, 1]
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Reconstruction, same shape as ``x``, values in [0, 1]."""
        return self.decoder(self.encoder(x))

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """Embedding ``[N, latent]``."""
        return self.encoder(x)


class _Crop(nn.Module):
    """The top-left h x w of a batch of images: undoes ConvAE's padding."""

    def __init__(self, h: int, w: int):
        super().__init__()
        self.h, self.w = h, w

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x[..., : self.h, : self.w]


def export_encoder_onnx(ae: ConvAE, in_shape: tuple[int, int, int]) -> bytes:
    """Serialize the encoder as one self-contained ONNX model (opset 17).

    Input ``images`` float32 ``[batch, C, H, W]``, output ``embedding``
    ``[batch, latent]``; the batch axis is dynamic. ``ae`` is exported in eval
    mode; its previous train/eval mode is restored afterwards.
    """
    was_training = ae.training
    ae.eval()
    try:
        p = next(ae.encoder.parameters())
        dummy = torch.zeros(2, *in_shape, dtype=torch.float32, device=p.device)
        buf = io.BytesIO()
        with warnings.catch_warnings(), torch.no_grad():
            # The TorchScript exporter is deprecated but needs no onnxscript
            # (not installed); the dynamo exporter (default since torch 2.9)
            # would fail without it.
            warnings.simplefilter("ignore")
            torch.onnx.export(
                ae.encoder,
                (dummy,),
                buf,  # type: ignore[arg-type]  # the stub names paths only; export writes file objects too
                dynamo=False,
                input_names=["images"],
                output_names=["embedding"],
                dynamic_axes={"images": {0: "batch"}, "embedding": {0: "batch"}},
                opset_version=17,
                do_constant_folding=True,
                export_params=True,
            )
    finally:
        ae.train(was_training)
    data = buf.getvalue()
    _check_self_contained(data)
    return data


def _check_self_contained(data: bytes) -> None:
    """Fail loudly if the model references external data files (bytes alone must suffice)."""
    import onnx
    from onnx.external_data_helper import uses_external_data

    model = onnx.load_model_from_string(data)
    if any(uses_external_data(t) for t in model.graph.initializer):
        raise RuntimeError("exported ONNX model references external data")
    onnx.checker.check_model(model)


def onnx_session(onnx_bytes: bytes, intra_op_num_threads: int = 1) -> InferenceSession:
    """CPU onnxruntime session for the exported encoder (1 thread: many emulated clients share a host)."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = int(intra_op_num_threads)
    opts.inter_op_num_threads = 1
    return ort.InferenceSession(onnx_bytes, sess_options=opts, providers=["CPUExecutionProvider"])


def onnx_embed(session: InferenceSession, x: np.ndarray, batch: int = 1024) -> np.ndarray:
    """Embed ``x`` float32 ``[N, C, H, W]`` in chunks of ``batch`` -> ``[N, latent]``."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    in_name = session.get_inputs()[0].name
    out_dim = session.get_outputs()[0].shape[-1]
    if len(x) == 0:
        return np.zeros((0, int(out_dim) if isinstance(out_dim, int) else 0), dtype=np.float32)
    outs = [session.run(None, {in_name: x[i : i + batch]})[0] for i in range(0, len(x), batch)]
    return np.concatenate(outs, axis=0).astype(np.float32, copy=False)
