"""The quality report's chart: perplexity change vs fp16 against bits per
coordinate (K and V, every layer, at the measured length), one panel per
model; tqkv's served presets and recipes as dots (with the range over rotation
seeds as a bar), vLLM's scheme emulated in numpy as crosses.

    python tools/quality/chart.py report.json build/quality_ppl_vs_bytes.png
"""
import json
import sys


def points(model_entry):
    out = []
    for r in model_entry.get("perplexity", []):
        if "bits_per_coord" not in r or "ppl_change_vs_fp16" not in r:
            continue
        if r["kind"] in ("exact", "fp16") or (r["kind"] == "served" and r["preset"] in
                                              ("fp16", "bf16")):
            continue
        out.append(r)
    return out


def label(r):
    if r["kind"] == "vllm":
        return "vLLM " + r["preset"].replace("turboquant_", "")
    name = r["name"].replace("turboquant_", "")
    return name


def plot(report, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    models = [(name, e) for name, e in report["models"].items() if points(e)]
    if not models:
        return
    fig, axes = plt.subplots(1, len(models), figsize=(6.5 * len(models), 5.2), squeeze=False)
    for ax, (name, entry) in zip(axes[0], models):
        for r in points(entry):
            y = 100 * r["ppl_change_vs_fp16"]
            lo, hi = (100 * x for x in r.get("ppl_change_range", [r["ppl_change_vs_fp16"]] * 2))
            if r["kind"] == "vllm":
                ax.scatter(r["bits_per_coord"], y, marker="x", s=60, color="tab:red", zorder=3)
            else:
                color = "tab:green" if r.get("recipe") else (
                    "tab:orange" if r.get("boundary") else "tab:blue")
                ax.errorbar(r["bits_per_coord"], y, yerr=[[y - lo], [hi - y]], fmt="o",
                            color=color, capsize=3, zorder=3)
            ax.annotate(label(r), (r["bits_per_coord"], y), textcoords="offset points",
                        xytext=(5, -11) if r["kind"] == "vllm" else (5, 4), fontsize=7,
                        color="tab:red" if r["kind"] == "vllm" else "black")
        ax.axhline(0, color="gray", lw=0.8)
        ax.set_xlabel("bits per coordinate (K+V, all layers, %d tokens)" %
                      entry["perplexity"][0].get("tokens", report.get("tokens", 0)))
        ax.set_ylabel("perplexity change vs fp16 (%)")
        m = entry["model"]
        chunk = entry.get("chunk", 0)
        title = "%s (head_dim %d; %s)" % (name, m["head_dim"], "%d-token Append + Attend steps"
                                          % chunk if chunk else "one Append + causal Attend")
        served = m.get("served_layers", m["full_attention_layers"])
        windowed = m["layers"] - len(m["full_attention_layers"])
        if windowed and len(served) == m["layers"]:
            title += "\nall %d layers served, %d of them sliding-window" % (m["layers"], windowed)
        elif windowed:
            title += "\nlayers %s compressed; the %d sliding-window layers stay fp16" % (
                m["full_attention_layers"], windowed)
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
    handles = [plt.Line2D([], [], marker="o", ls="", color="tab:blue", label="tqkv preset"),
               plt.Line2D([], [], marker="o", ls="", color="tab:orange",
                          label="tqkv, first/last 2 layers fp16"),
               plt.Line2D([], [], marker="o", ls="", color="tab:green", label="tqkv recipe"),
               plt.Line2D([], [], marker="x", ls="", color="tab:red",
                          label="vLLM's scheme (numpy)")]
    fig.legend(handles=handles, loc="lower center", ncol=4, fontsize=8, frameon=False)
    fig.suptitle("Perplexity change vs KV bytes (bars: range over rotation seeds)", fontsize=11)
    fig.tight_layout(rect=(0, 0.06, 1, 0.95))
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    plot(json.loads(open(sys.argv[1]).read()), sys.argv[2])
