"""experiments/notebooks/quickstart.ipynb runs top to bottom (its code cells, in order)."""

import json
import os

import matplotlib
from _helpers import ROOT

NOTEBOOK = os.path.join(ROOT, "experiments", "notebooks", "quickstart.ipynb")


def test_quickstart_notebook_runs(tmp_path, monkeypatch):
    matplotlib.use("Agg")  # plt.show() is a no-op
    monkeypatch.setenv("TMPDIR", str(tmp_path))
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
