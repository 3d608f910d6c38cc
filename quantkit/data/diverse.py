"""Diverse calibration windows: candidates embedded as TF-IDF vectors of their tokens, clustered from farthest-point
seeds, one window per cluster, so the windows span the text's topics instead of clustering where the text is long."""

from __future__ import annotations


def select_diverse(candidates: list[list[int]], count: int, seed: int) -> list[list[int]]:
    """Windows that cover the text, one per cluster of similar windows.

    Features: TF-IDF over token ids, reduced with truncated SVD and L2-normalised. Clusters: k-means
    started from farthest-point (k-center) seeds, so every well-separated region of the text gets a centre
    however few windows it has; the window nearest each centre is chosen.
    """
    if len(candidates) <= count:
        return candidates
    import numpy as np
    from sklearn.cluster import KMeans
    from sklearn.decomposition import TruncatedSVD
    from sklearn.feature_extraction.text import TfidfVectorizer
    from sklearn.preprocessing import normalize

    docs = [" ".join(map(str, window)) for window in candidates]
    sparse = TfidfVectorizer(token_pattern=r"\S+", sublinear_tf=True).fit_transform(docs)
    components = min(64, sparse.shape[1] - 1, sparse.shape[0] - 1)
    dense = TruncatedSVD(components, random_state=seed).fit_transform(sparse) if components >= 2 else sparse.toarray()
    features = normalize(dense)
    seeds = farthest_points(features, count)
    kmeans = KMeans(n_clusters=count, init=features[seeds], n_init=1, random_state=seed).fit(features)
    distances = kmeans.transform(features)
    chosen: list[int] = []
    for cluster in range(count):
        members = np.flatnonzero(kmeans.labels_ == cluster)
        if len(members):
            chosen.append(int(members[distances[members, cluster].argmin()]))
    for index in seeds:  # a cluster emptied by k-means keeps its seed window
        if len(chosen) < count and index not in chosen:
            chosen.append(index)
    return [candidates[i] for i in chosen]


def farthest_points(features, count: int) -> list[int]:
    """Greedy k-center: start nearest the mean, then repeatedly take the point farthest from those taken."""
    import numpy as np

    first = int(np.linalg.norm(features - features.mean(axis=0), axis=1).argmin())
    chosen = [first]
    nearest = np.linalg.norm(features - features[first], axis=1)
    while len(chosen) < count:
        index = int(nearest.argmax())
        chosen.append(index)
        nearest = np.minimum(nearest, np.linalg.norm(features - features[index], axis=1))
    return chosen
