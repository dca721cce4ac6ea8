"""The README's configuration reference is generated from the traitlets and kept current;
every configurable trait explains itself."""

from pathlib import Path

from jupyter_gpupool.configref import BEGIN, CONFIGURABLES, END, _load, reference

ROOT = Path(__file__).resolve().parent.parent


def test_readme_reference_is_up_to_date():
    text = (ROOT / "README.md").read_text()
    section = text.split(BEGIN, 1)[1].split(END, 1)[0].strip()
    assert section == reference().strip(), "run: python -m jupyter_gpupool.configref --write README.md"


def test_every_configurable_trait_has_help():
    missing = []
    for path, _ in CONFIGURABLES:
        cls = _load(path)
        for name, trait in cls.class_own_traits(config=True).items():
            if not (trait.help or "").strip():
                missing.append(f"{cls.__name__}.{name}")
    assert not missing, f"traits without help=: {missing}"
