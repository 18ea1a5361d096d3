"""The configuration presets: one YAML file each, named for the run it sets up (``asyncrl.config.load_config``
reads them). Listing them imports nothing heavy, so ``asyncrl --help`` shows them without loading torch."""

from pathlib import Path

PRESETS = Path(__file__).parent


def presets() -> list[str]:
    return sorted(p.stem for p in PRESETS.glob("*.yaml"))
