"""The offline index: a clustering of the LM head rows, saved as one safetensors file.

For cluster ``c`` with centroid ``mu_c`` the index stores the radius
``R_c = max_{i in c} ||w_i - mu_c||`` (computed in float64 from the stored fp32
centroid, then rounded up), ``bmax_c = max_{i in c} b_i`` and ``wmax_c = max ||w_i||``,
so that ``<w_i, h> + b_i <= <mu_c, h> + R_c ||h|| + bmax_c`` holds for every token
(Cauchy-Schwarz). The file is fingerprinted against the weights it was built from, and
carries a digest of its own tensors: a file damaged after it was written (a flipped bit in a
radius would make the bound unsound without making the file unreadable) is refused at load.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .errors import CSVError
from .fp import round_up32
from .kmeans import KMEANS
from .vocabulary import CLUSTER_FRACTION as DEFAULT_CLUSTER_FRACTION  # (C = 0.015 V)

FORMAT_VERSION = "2"  # 2: the file carries a digest of its tensors
TENSORS = ("perm", "offsets", "centroids", "radii", "bias_max", "row_norm_max")


def fingerprint_weights(weight: torch.Tensor, bias: torch.Tensor | None = None) -> str:
    """blake2b over the shape and the fp32 bytes of the head (and bias): changes with any
    weight, and is the same whichever dtype the head is served in (bf16/fp16 -> fp32 is exact)."""
    hsh = hashlib.blake2b(digest_size=16)
    for t in (weight, bias):
        if t is None:
            hsh.update(b"none")
            continue
        t = t.detach().float().contiguous().cpu()
        hsh.update(json.dumps([list(t.shape), str(t.dtype)]).encode())
        hsh.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return hsh.hexdigest()


def tensors_digest(tensors: dict[str, torch.Tensor]) -> str:
    """blake2b over the index tensors (name, dtype, shape, bytes): written into the file at
    :meth:`CSVIndex.save` and checked at :meth:`CSVIndex.load`."""
    hsh = hashlib.blake2b(digest_size=16)
    for name in TENSORS:
        t = tensors[name].detach().contiguous().cpu()
        hsh.update(json.dumps([name, list(t.shape), str(t.dtype)]).encode())
        hsh.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return hsh.hexdigest()


def default_num_clusters(vocab_size: int) -> int:
    return max(1, round(DEFAULT_CLUSTER_FRACTION * vocab_size))


@dataclass
class CSVIndex:
    """Clusters of the vocabulary. ``perm`` lists token ids cluster by cluster;
    cluster ``c`` owns ``perm[offsets[c]:offsets[c+1]]``."""

    perm: torch.Tensor  # [V] int64
    offsets: torch.Tensor  # [C+1] int64
    centroids: torch.Tensor  # [C, d] fp32
    radii: torch.Tensor  # [C] fp32, rounded up
    bias_max: torch.Tensor  # [C] fp32 (zeros without bias)
    row_norm_max: torch.Tensor  # [C] fp32, max ||w_i|| in the cluster (for fp margins)
    fingerprint: str
    meta: dict

    @property
    def num_clusters(self) -> int:
        return self.centroids.shape[0]

    @property
    def vocab_size(self) -> int:
        return self.perm.shape[0]

    @property
    def hidden_size(self) -> int:
        return self.centroids.shape[1]

    @property
    def sizes(self) -> torch.Tensor:
        return self.offsets[1:] - self.offsets[:-1]

    def cluster_of(self) -> torch.Tensor:
        """``[V]`` cluster id of every token."""
        out = torch.empty_like(self.perm)
        out[self.perm] = torch.repeat_interleave(torch.arange(self.num_clusters), self.sizes)
        return out

    def check_bounds(self, weight: torch.Tensor, bias: torch.Tensor | None, chunk: int = 8192) -> None:
        """Raise :class:`CSVError` unless the stored radii, bias maxima and row-norm maxima bound
        ``weight`` and ``bias`` (``[V, d]``, ``[V]``) as :func:`build_index` computes them (float64
        distances to the stored fp32 centroids, rounded up): the fingerprint says which weights a
        file was built for, not that its numbers are right for them (a file written by another
        tool or version, or edited, with the right fingerprint). One pass over the rows, ``chunk``
        at a time."""
        C, V = self.num_clusters, self.vocab_size
        labels = self.cluster_of().to(weight.device)
        mu = self.centroids.to(weight.device).double()
        radii = torch.zeros(C, dtype=torch.float64, device=weight.device)
        wmax = torch.zeros_like(radii)
        for a in range(0, V, chunk):
            w, lab = weight[a:a + chunk].double(), labels[a:a + chunk]
            radii.scatter_reduce_(0, lab, (w - mu[lab]).norm(dim=1), "amax")
            wmax.scatter_reduce_(0, lab, w.norm(dim=1), "amax")
        bmax = torch.zeros_like(radii) if bias is None else torch.full_like(radii, -torch.inf).scatter_reduce_(
            0, labels, bias.double(), "amax")
        for name, need, have in (("radii", radii, self.radii), ("row norms", wmax, self.row_norm_max),
                                 ("bias maxima", bmax, self.bias_max)):
            # (2^-30 relative slack: the float64 sums' order may differ from the build's in the last
            # bits; the ball screen widens every radius by (1 + 4u) and gamma terms well beyond it)
            need = need.cpu()
            if bool((need - need.abs() * 2.0**-30 > have.cpu().double()).any()):
                raise CSVError(f"CSV index: its {name} do not bound this head's rows (the file carries these "
                               "weights' fingerprint but not their numbers); rebuild it with `vllm-csv build-index`")

    def to(self, device) -> "CSVIndex":
        mv = lambda t: t.to(device)  # noqa: E731
        return CSVIndex(mv(self.perm), mv(self.offsets), mv(self.centroids), mv(self.radii),
                        mv(self.bias_max), mv(self.row_norm_max), self.fingerprint, self.meta)

    # ---- persistence -------------------------------------------------------------------
    def save(self, path: str | os.PathLike) -> Path:
        """Write atomically: a temp file in the same directory, then ``os.replace``."""
        path = Path(path)
        tensors = {k: getattr(self, k).contiguous().cpu() for k in TENSORS}
        meta = {k: str(v) for k, v in self.meta.items()}
        meta.update(format_version=FORMAT_VERSION, fingerprint=self.fingerprint, digest=tensors_digest(tensors))
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
            os.close(fd)
        except OSError as e:
            raise CSVError(f"cannot write index to {path}: {e.strerror or e}") from None
        try:
            save_file(tensors, tmp, metadata=meta)
            os.replace(tmp, path)
        except OSError as e:
            raise CSVError(f"cannot write index to {path}: {e.strerror or e}") from None
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        return path

    @classmethod
    def load(cls, path: str | os.PathLike, expect_fingerprint: str | None = None) -> "CSVIndex":
        """Load and validate; raise :class:`CSVError` if the file is missing, corrupt (unreadable,
        or its tensors differ from the digest saved with them), of another format version,
        inconsistent, or built from other weights."""
        path = Path(path)
        if not path.is_file():
            raise CSVError(f"CSV index not found: {path}")
        try:
            with safe_open(str(path), framework="pt") as f:
                meta = f.metadata() or {}
                # Copies: safetensors' tensors may share the file's memory map, and a file
                # replaced or rewritten in place while serving would then change the bound
                # under the running head (or kill it with SIGBUS when truncated).
                t = {k: f.get_tensor(k).clone() for k in f.keys()}
        except Exception as e:  # safetensors raises several types for corrupt files
            raise CSVError(f"CSV index {path} is corrupt or not a safetensors file ({e})") from None
        if meta.get("format_version") != FORMAT_VERSION:
            raise CSVError(f"CSV index {path} has format version {meta.get('format_version')!r}, "
                           f"expected {FORMAT_VERSION!r}; rebuild it with `vllm-csv build-index`")
        if any(k not in t for k in TENSORS):
            raise CSVError(f"CSV index {path} is corrupt: missing tensors {sorted(set(TENSORS) - set(t))}")
        if meta.get("digest") != tensors_digest(t):
            raise CSVError(f"CSV index {path} is corrupt: its tensors do not match the digest written with them")
        idx = cls(*(t[k] for k in TENSORS), meta.get("fingerprint", ""),
                  {k: v for k, v in meta.items() if k not in ("format_version", "fingerprint", "digest")})
        idx._validate(path)
        if expect_fingerprint is not None and idx.fingerprint != expect_fingerprint:
            raise CSVError(f"CSV index {path} was built for other weights (fingerprint {idx.fingerprint}, "
                           f"model has {expect_fingerprint}); rebuild it with `vllm-csv build-index`")
        return idx

    def _validate(self, path) -> None:
        V, C = self.perm.shape[0], self.centroids.shape[0]
        ok = (
            self.perm.dtype == torch.int64 and self.offsets.shape == (C + 1,)
            and self.offsets[0] == 0 and self.offsets[-1] == V and bool((self.sizes > 0).all())
            and torch.equal(torch.sort(self.perm).values, torch.arange(V))
            and all(x.shape == (C,) for x in (self.radii, self.bias_max, self.row_norm_max))
            and bool(torch.isfinite(self.centroids).all()) and bool((self.radii >= 0).all())
        )
        if not ok:
            raise CSVError(f"CSV index {path} is corrupt: inconsistent clusters")


def build_index(
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    num_clusters: int | None = None,
    *,
    method: str = "torch",
    iters: int = 25,
    seed: int = 0,
    progress: bool = True,
) -> CSVIndex:
    """Cluster the ``V`` rows of ``weight`` into ``num_clusters`` (default ``0.015 V``)."""
    if weight.dim() != 2 or not weight.is_floating_point():
        raise CSVError(f"LM head must be a 2-D floating-point matrix, got {tuple(weight.shape)} {weight.dtype}")
    if not torch.isfinite(weight).all() or (bias is not None and not torch.isfinite(bias).all()):
        raise CSVError("LM head contains NaN or inf; refusing to build an index")
    V, d = weight.shape
    C = default_num_clusters(V) if num_clusters is None else num_clusters
    if not 1 <= C <= V:
        raise CSVError(f"--clusters must be between 1 and the vocabulary size {V}, got {C}")
    if method not in KMEANS:
        raise CSVError(f"unknown k-means method {method!r}; choose one of {sorted(KMEANS)}")
    t0 = time.perf_counter()
    w = weight.detach().float()
    labels, centroids = KMEANS[method](w, C, iters=iters, seed=seed, progress=progress)
    # Drop clusters that ended empty so that every stored cluster has a member.
    used = torch.unique(labels)
    remap = torch.full((C,), -1, dtype=torch.long)
    remap[used] = torch.arange(used.numel())
    labels, centroids = remap[labels.cpu()], centroids.cpu()[used].contiguous()
    C = used.numel()
    perm = torch.argsort(labels, stable=True)
    sizes = torch.bincount(labels, minlength=C)
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), sizes.cumsum(0)])
    w64 = w.cpu().double()
    dist = (w64 - centroids.double()[labels]).norm(dim=1)
    radii = torch.zeros(C, dtype=torch.float64).scatter_reduce(0, labels, dist, "amax")
    radii = round_up32(radii)
    wmax = round_up32(torch.zeros(C, dtype=torch.float64).scatter_reduce(0, labels, w64.norm(dim=1), "amax"))
    if bias is None:
        bmax = torch.zeros(C)
    else:
        bmax = round_up32(torch.full((C,), -torch.inf, dtype=torch.float64).scatter_reduce(
            0, labels, bias.detach().cpu().double(), "amax"))
    meta = {"vocab_size": V, "hidden_size": d, "num_clusters": C, "method": method, "seed": seed,
            "build_seconds": round(time.perf_counter() - t0, 3)}
    return CSVIndex(perm, offsets, centroids, radii, bmax, wmax, fingerprint_weights(weight, bias), meta)

