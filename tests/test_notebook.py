"""notebooks/compare_methods.ipynb runs top to bottom (tiny settings), so it cannot rot."""

from pathlib import Path

import nbformat
from nbclient import NotebookClient

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "compare_methods.ipynb"


def test_notebook_runs_offline_and_plots(monkeypatch, tmp_path):
    monkeypatch.setenv("CTXEXT_NOTEBOOK_TINY", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("CTXEXT_RESULTS", raising=False)
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    NotebookClient(
        notebook, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(NOTEBOOK.parent)}}
    ).execute()
    outputs = [o for cell in notebook.cells if cell.cell_type == "code" for o in cell.get("outputs", [])]
    assert not [o for o in outputs if o.output_type == "error"]
    images = [o for o in outputs if o.output_type == "display_data" and "image/png" in o.get("data", {})]
    assert len(images) == 3  # perplexity against length, the frequency picture, the remapped positions
    text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    table = "".join(str(o.get("data", {}).get("text/plain", "")) for o in outputs)
    assert "tokens scored per length" in text and "yarn x4" in table
    assert all(label in table for label in ("rerope w16 +logn", "self_extend G4 w16", "dual_chunk", "string W4"))
