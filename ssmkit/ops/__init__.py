"""The math of the mixers, as functions (no nn.Module).

Each op dispatches to a backend (``reference`` | ``torch`` | ``cuda``, see
:mod:`ssmkit.ops.backend`):

* :func:`selective_scan`, :func:`selective_state_update` -- Mamba-1's S6 scan and its one-step form
* :func:`ssd_scan` -- Mamba-2's state-space dual; :func:`ssd_reference`, :func:`ssd_quadratic`,
  :func:`ssd_chunked` are its three equivalent views; :func:`ssd_chunked_recompute` is the chunked
  view with a backward that recomputes by segments (long sequences; :func:`ssd_recompute` forces it
  on or off)
* :mod:`ssmkit.ops.recompute` -- gradient checkpointing over time for any scan with a carried state
  (:func:`~ssmkit.ops.recompute.scan_in_segments`)
* :func:`causal_conv1d`, :func:`causal_conv1d_update` -- the short depthwise convolution and its
  generation form
* :data:`ACTIVATIONS`, :func:`activation` -- pointwise activations by transformers' names
  (``hidden_act``), for the conv and the MLPs (:mod:`ssmkit.ops.activations`)
* :func:`rms_norm`, :func:`rms_norm_gated` -- RMSNorm and Mamba-2's gated, grouped RMSNorm
* :func:`mamba3_scan`, :func:`mamba3_step` -- Mamba-3's exponential-trapezoidal, rotating scan (SISO
  and MIMO) and its one-step form; :func:`mamba3_reference`, :func:`mamba3_quadratic`,
  :func:`mamba3_chunked` are its three equivalent views
* the generation forms (``*_update``, ``*_step``) take one token or k in one call (a token axis: the
  verification step of speculative decoding), equal to k one-token calls
* :mod:`ssmkit.ops.lti` -- the linear time-invariant SSM of S4 / S4D: :func:`discretize` (ZOH,
  bilinear), the kernel by :func:`kernel_by_powers` or :func:`kernel_vandermonde`, run as
  :func:`ssm_recurrent` (:func:`ssm_step`) or :func:`ssm_convolve` (FFT); :func:`state_after`,
  :func:`state_response` carry a state across a convolution; :func:`shift_ssm` is H3's
* :mod:`ssmkit.ops.hippo` -- HiPPO-LegS (:func:`legs`), S4's NPLR form (:func:`legs_nplr`,
  :func:`nplr_to_dense`), S4D's diagonal inits (:func:`s4d_init`), and the online memory
  (:func:`legs_memory`, :func:`legs_reconstruct`)
* :mod:`ssmkit.ops.packing` -- packed samples: every op above but the one-step forms takes
  ``seq_idx`` (batch, seqlen), the sample index of each position, and restarts at every sample;
  :func:`seq_idx_from_position_ids` makes it from position ids that restart at 0; every scan and
  the conv also take one initial state per sample and return every sample's final state
  (``initial_sample_states``, ``return_sample_states``)
* :mod:`ssmkit.ops.sample_states` -- those per-sample states for :func:`ssd_scan` and
  :func:`mamba3_scan`, by linearity
* :func:`compile_scan` -- opt-in: the torch backend's S6 and SSD scans through ``torch.compile``
  (:mod:`ssmkit.ops.compiled`; also ``SSMKIT_COMPILE_SCAN=1``)
* :mod:`ssmkit.ops.tolerances` -- the official kernels' test tolerances per dtype (and the fp32
  bound) that the tests and scripts/gpu_check hold the torch backend to
"""

from .activations import ACTIVATIONS, activation
from .backend import BACKENDS, BackendError
from .compiled import compile_scan
from .conv import causal_conv1d, causal_conv1d_reference, causal_conv1d_torch, causal_conv1d_update
from .hippo import (
    S4D_INITS,
    legendre,
    legs,
    legs_memory,
    legs_nplr,
    legs_reconstruct,
    nplr_to_dense,
    s4d_init,
)
from .lti import (
    discretize,
    kernel_by_powers,
    kernel_vandermonde,
    shift_ssm,
    ssm_convolve,
    ssm_recurrent,
    ssm_step,
    state_after,
    state_response,
    vandermonde,
)
from .mamba3 import mamba3_chunked, mamba3_quadratic, mamba3_scan, mamba3_step
from .mamba3_ref import Mamba3States, a_activation, heavy_tail, mamba3_reference, rope_angles
from .norm import rms_norm, rms_norm_gated
from .packing import (
    cu_seqlens,
    positions_in_sample,
    sample_numbers,
    sample_spans,
    seq_idx_from_position_ids,
)
from .s6 import selective_scan, selective_scan_reference, selective_scan_torch
from .s6_step import selective_state_update
from .ssd import (
    discretize_dt,
    segsum,
    ssd_chunked,
    ssd_chunked_recompute,
    ssd_quadratic,
    ssd_recompute,
    ssd_reference,
    ssd_scan,
)

__all__ = [
    "ACTIVATIONS",
    "activation",
    "BACKENDS",
    "BackendError",
    "compile_scan",
    "causal_conv1d",
    "causal_conv1d_reference",
    "causal_conv1d_torch",
    "causal_conv1d_update",
    "rms_norm",
    "rms_norm_gated",
    "selective_scan",
    "selective_scan_reference",
    "selective_scan_torch",
    "selective_state_update",
    "discretize_dt",
    "segsum",
    "ssd_chunked",
    "ssd_chunked_recompute",
    "ssd_quadratic",
    "ssd_recompute",
    "ssd_reference",
    "ssd_scan",
    "Mamba3States",
    "a_activation",
    "heavy_tail",
    "mamba3_chunked",
    "mamba3_quadratic",
    "mamba3_reference",
    "mamba3_scan",
    "mamba3_step",
    "rope_angles",
    "S4D_INITS",
    "discretize",
    "kernel_by_powers",
    "kernel_vandermonde",
    "legendre",
    "legs",
    "legs_memory",
    "legs_nplr",
    "legs_reconstruct",
    "nplr_to_dense",
    "s4d_init",
    "shift_ssm",
    "ssm_convolve",
    "ssm_recurrent",
    "ssm_step",
    "state_after",
    "state_response",
    "vandermonde",
    "cu_seqlens",
    "positions_in_sample",
    "sample_numbers",
    "sample_spans",
    "seq_idx_from_position_ids",
]
