"""An FCR clustering in words, for a person at the terminal: what `flt relate` prints, and
what `flt run` prints after FLT's set-up and after every re-clustering."""

from __future__ import annotations


def describe_clustering(r: dict) -> list[str]:
    """The clusters found (sizes, silhouette, separation), how they compare with the planted
    ones, and why not one cluster more (server/fcr.py next_cut), from an FCR report; no
    lines for a report that holds no clustering."""
    if "clusters" not in r:
        return []
    sizes = ", ".join(map(str, r.get("cluster_sizes", [])))
    sil = f", silhouette {r['silhouette']:.3f}" if r.get("silhouette") is not None else ""
    if r.get("separation") is not None:  # of the best cut, kept or not (server/fcr.py)
        sil += f", separation {r['separation']:.3f}"
    if r.get("chosen_by") == "halves":  # C from the held-out test (server/fcr.py HeldOut)
        sil += ", C set by the held-out halves"
    if "ari" in r:
        planted = f" against {r['planted_clusters']} planted clusters" if "planted_clusters" in r else ""
        quality = f"ARI {r['ari']:.3f}, NMI {r['nmi']:.3f}{planted}"
    else:
        quality = "no planted clusters to compare with"
    lines = [f"{clusters_of(r['clusters'], sizes)}{sil}", quality]
    if r.get("gamma") is not None and "mean_degree" in r:  # a threshold graph: Case I trains on it
        lines.append(f"graph A~ = [A <= {r['gamma']:.4g}]: {r['mean_degree']:.2f} neighbours a client, itself included")
    why = why_not_more(r.get("next_cut"), r.get("pipeline") or {})
    return lines + ([why] if why else [])


def why_not_more(cut: dict | None, pipeline: dict) -> str:
    """The cut with one cluster more (server/fcr.py next_cut) in a line, or ''."""
    if not cut:
        return ""
    z = cut.get("heldout_z")
    held = (
        f", held-out z {round(min(z), 1) + 0.0:.1f} for the split it adds "  # + 0.0: no "-0.0"
        f"(min_heldout_keep {pipeline.get('min_heldout_keep', 0):.1f})"
        if z
        else ""
    )
    return (
        f"why not {cut['clusters']}: weakest split score {cut['weakest_split_score']:.2f} "
        f"(min_split {pipeline.get('min_split', 0):.2f}), smallest cluster {cut['smallest_cluster']}{held}"
    )


def clusters_of(c: int, sizes: str) -> str:
    """'5 clusters of sizes [4, 4, ...]', or '1 cluster of size [20]'."""
    return f"{c} clusters of sizes [{sizes}]" if c != 1 else f"1 cluster of size [{sizes}]"
