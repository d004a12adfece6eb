"""experiments/notebooks/quickstart.ipynb runs top to bottom (its code cells, in order) and saves
its plots and its run to runs/quickstart/ (under the directory it runs in)."""

import json
import os
import re

import matplotlib
from _helpers import ROOT

NOTEBOOK = os.path.join(ROOT, "experiments", "notebooks", "quickstart.ipynb")


def test_quickstart_notebook_runs(tmp_path, monkeypatch, capsys):
    matplotlib.use("Agg")  # plt.show() is a no-op
    monkeypatch.chdir(tmp_path)
    with open(NOTEBOOK) as f:
        cells = [c for c in json.load(f)["cells"] if c["cell_type"] == "code"]
    namespace = {"__name__": "__main__"}
    for i, cell in enumerate(cells):
        exec(
            compile("".join(cell["source"]), f"quickstart.ipynb[code cell {i}]", "exec"), namespace
        )
    assert namespace["result"].step == 8
    assert namespace["aux8"].expert_counts.tolist() == namespace["aux"].expert_counts.tolist()
    assert float(abs(namespace["y8"] - namespace["y"]).max()) < 1e-4
    out = tmp_path / "runs" / "quickstart"
    assert namespace["OUT"] == out
    for name in ("routing.png", "training.png", "run/loss.png", "run/metrics.jsonl"):
        assert (out / name).stat().st_size > 0, name
    # The top-k weights print as 3 decimals, not float32 noise (0.5049999952316284).
    (line,) = [x for x in capsys.readouterr().out.splitlines() if "and their weights" in x]
    numbers = re.findall(r"\d+\.\d+", line)
    assert len(numbers) == 8 and all(len(n.split(".")[1]) <= 3 for n in numbers), line
