"""K-means over the rows of the LM head (spherical geometry is not assumed).

Two implementations of the same Lloyd iteration: scikit-learn's ``KMeans`` (the
reference) and a chunked torch version (faster on large vocabularies, GPU-ready).
Both return ``labels [V]`` and ``centroids [C, d]`` as float32 tensors; the index
recomputes radii itself from whatever centroids it is given, so the soundness of
the bound never depends on convergence.
"""

from __future__ import annotations

import torch
from tqdm.auto import tqdm


def _assign(x: torch.Tensor, centroids: torch.Tensor, chunk: int = 16384) -> torch.Tensor:
    """Nearest centroid for every row: argmin_c ||x - mu_c||^2 = argmin_c (||mu_c||^2 - 2 <x, mu_c>)."""
    cn = (centroids * centroids).sum(1)
    out = torch.empty(x.shape[0], dtype=torch.long, device=x.device)
    for s in range(0, x.shape[0], chunk):
        out[s : s + chunk] = (cn - 2.0 * x[s : s + chunk] @ centroids.T).argmin(1)
    return out


def torch_kmeans(
    x: torch.Tensor, num_clusters: int, *, iters: int = 25, seed: int = 0, progress: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Lloyd's algorithm with k-means++-style seeding on a random subsample; empty
    clusters are re-seeded with the rows farthest from their centroid."""
    x = x.float()
    n = x.shape[0]
    g = torch.Generator(device="cpu").manual_seed(seed)
    centroids = x[torch.randperm(n, generator=g)[:num_clusters].to(x.device)].clone()
    labels = _assign(x, centroids)
    for _ in tqdm(range(iters), desc="k-means", disable=not progress, unit="it"):
        sums = torch.zeros_like(centroids).index_add_(0, labels, x)
        counts = torch.bincount(labels, minlength=num_clusters)
        empty = counts == 0
        centroids = torch.where(empty[:, None], centroids, sums / counts.clamp_min(1)[:, None])
        if empty.any():
            far = ((x - centroids[labels]) ** 2).sum(1).topk(int(empty.sum())).indices
            centroids[empty] = x[far]
        new = _assign(x, centroids)
        if torch.equal(new, labels):
            break
        labels = new
    return labels, centroids


def sklearn_kmeans(
    x: torch.Tensor, num_clusters: int, *, iters: int = 25, seed: int = 0, progress: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """scikit-learn's ``KMeans`` (k-means++ init, one run) as the reference implementation."""
    from sklearn.cluster import KMeans

    km = KMeans(n_clusters=num_clusters, n_init=1, max_iter=iters, random_state=seed)
    with tqdm(total=1, desc="k-means (scikit-learn)", disable=not progress) as bar:
        km.fit(x.float().cpu().numpy())
        bar.update(1)
    return torch.from_numpy(km.labels_).long(), torch.from_numpy(km.cluster_centers_).float()


KMEANS = {"torch": torch_kmeans, "sklearn": sklearn_kmeans}
