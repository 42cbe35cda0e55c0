"""The training corpus shipped with the package: `CORPUS_PATH` (`corpus.txt`, 394 KB of simple English
stories, the project's own text under Apache-2.0; see README.md beside it for how it was made).

It is the default text of `mla-train` and what the built-in model (`models.builtin`) was trained on.
It lives inside the package so an installed wheel trains with no arguments, as a checkout does.
"""

import os

CORPUS_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "corpus.txt")
