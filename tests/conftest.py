import torch
import pytest

torch.set_num_threads(2)


def peaked_head(V: int, d: int, seed: int = 0, dtype=torch.float32):
    """A head whose logits have a clear winner for hidden states built from its rows
    (like a learned head): h = a * w_t + noise, so token t tends to be the top-1."""
    g = torch.Generator().manual_seed(seed)
    W = torch.randn(V, d, generator=g) / d**0.5
    return W.to(dtype), g


def peaked_rows(seed, R=48, V=8192):
    """``(y, g)``: rows shaped like a learned head's after temperature, a few leading tokens over
    a long tail, with exact ties (columns 0-4 equal to 5-9); ``g`` the generator, to draw on."""
    g = torch.Generator().manual_seed(seed)
    y = torch.randn(R, V, generator=g) * 2
    lead = torch.randint(0, V, (R, 8), generator=g)
    y.scatter_(1, lead, torch.rand(R, 8, generator=g) * 12 + 4)
    y[:, :5] = y[:, 5:10]  # exact ties
    return y, g


def hidden_near_rows(W: torch.Tensor, B: int, g, scale: float = 6.0, noise: float = 0.3):
    t = torch.randint(0, W.shape[0], (B,), generator=g)
    h = scale * W[t].float() * W.shape[1] ** 0.5 + noise * torch.randn(B, W.shape[1], generator=g)
    return h.to(W.dtype)


def dense_topk(W, b, h, k, softcap=None, scale=1.0):
    z = torch.nn.functional.linear(h, W, b)
    if softcap is not None:
        z = torch.tanh(z / softcap) * softcap
    z = z * scale if scale != 1.0 else z
    vals, ids = torch.sort(z, dim=1, descending=True, stable=True)
    return ids[:, :k], vals[:, :k], z


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-for-bit equality (``torch.equal`` counts ``-0.0 == 0.0`` and never ``NaN == NaN``)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return torch.equal(a.contiguous().view(ints), b.contiguous().view(ints))


class FakeClock:
    """``time`` for the plugin's modules: advances only by the simulated costs."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self):
        return self.now


def csv_layer(head, metrics=None):
    """The plugin's LM-head layer (``CSVLogitsProcessor``) around ``head``, built without vLLM's
    constructor (no vLLM config), as its first ``forward`` leaves it."""
    from vllm_csv.vllm_plugin.logits_processor import CSVLogitsProcessor

    return CSVLogitsProcessor.around(head, metrics)


@pytest.fixture(autouse=True)
def _private_cache(tmp_path_factory, monkeypatch):
    """Tests never write to the user's cache."""
    monkeypatch.setenv("VLLM_CSV_CACHE", str(tmp_path_factory.getbasetemp() / "cache"))


@pytest.fixture
def torch_reference_step(monkeypatch):
    """The certified step's torch reference instead of the fused CPU kernels
    (:mod:`vllm_csv.ops.step`), for tests that mutate the reference's Python arithmetic
    (the kernels are checked against that reference in ``tests/test_step.py``)."""
    from vllm_csv.ops import build

    monkeypatch.setitem(build._state, "ops", None)
