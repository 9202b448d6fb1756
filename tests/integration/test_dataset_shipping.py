"""A dataset class defined in a script travels by value (cloudpickle) to another process, as
``launch()`` ships a run's config to its worker."""

from __future__ import annotations

from pathlib import Path


def test_a_script_defined_dataset_ships_by_value_to_another_process(tmp_path: Path) -> None:
    # launch() cloudpickles the config: a class defined in a script's __main__ travels by value.
    import subprocess
    import sys

    blob = tmp_path / "config.pkl"
    define = (
        "import cloudpickle\n"
        "from palaestra.data import HuggingFaceDataset, builtin_dataset\n"
        "class HaikuDataset(HuggingFaceDataset):\n"
        "    hf_repo = str(builtin_dataset('haiku'))\n"
        "    input_column = 'keywords'\n"
        "ds = HaikuDataset(hf_split='train[:5]')\n"
        "ds.load()\n"
        f"open({str(blob)!r}, 'wb').write(cloudpickle.dumps(ds))\n"
    )
    use = (
        "import cloudpickle\n"
        f"ds = cloudpickle.loads(open({str(blob)!r}, 'rb').read())\n"
        "assert ds._rows is None and len(ds.load()) == 5, ds\n"
        "assert type(ds).input_column == 'keywords'\n"
        "print(repr(ds))\n"
    )
    subprocess.run([sys.executable, "-c", define], check=True, timeout=120)
    done = subprocess.run(
        [sys.executable, "-c", use], check=True, timeout=120, capture_output=True, text=True
    )
    assert done.stdout.strip() == "HaikuDataset(hf_split='train[:5]')"
