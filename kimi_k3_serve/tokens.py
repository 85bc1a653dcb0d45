"""What a credential looks like, whatever field it was put in.

``config.secrets`` refuses fields whose *name* says they hold a secret; a token pasted into some other field (a model
source, an ``--env`` value, an address) has an ordinary name, so it is known by its *shape* instead: the prefixes the
common issuers give their tokens, a JWT, a password in a URL. Every error and every printed command line passes
through ``mask_tokens``, so such a value is never echoed back.
"""

from __future__ import annotations

import re

REDACTED = "<redacted>"

TOKEN_SHAPES = re.compile(
    r"(?<![A-Za-z0-9_-])(?:"  # a prefix starts a word: "task-scheduling-..." holds no "sk-" key
    + "|".join((
        r"hf_[A-Za-z0-9]{20,}",  # Hugging Face
        r"(?:sk|rk|pk)-(?=[A-Za-z_-]*[0-9])[A-Za-z0-9_-]{20,}",  # OpenAI-style API keys: random, so with a digit
        r"gh[pousr]_[A-Za-z0-9]{30,}",  # GitHub tokens
        r"github_pat_[A-Za-z0-9_]{30,}",
        r"glpat-[A-Za-z0-9_-]{20,}",  # GitLab
        r"xox[abprs]-[A-Za-z0-9-]{10,}",  # Slack
        r"(?:AKIA|ASIA)[A-Z0-9]{16}(?![A-Za-z0-9])",  # AWS access key IDs
        r"AIza[0-9A-Za-z_-]{35}",  # Google API keys
        r"eyJ[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}",  # JWTs
        r"(?i:bearer)\s+(?=[A-Za-z._~+/=-]*[0-9])[A-Za-z0-9._~+/=-]{16,}",  # "Bearer authentication" is prose
    ))
    + ")"
)
URL_PASSWORD = re.compile(r"(?<=://)([^/@\s:]*):[^/@\s]+@")
"""``scheme://user:password@host``: the user is kept, the password is not."""


def looks_like_token(text: str) -> bool:
    """Whether ``text`` holds something shaped like a credential."""
    return bool(TOKEN_SHAPES.search(text) or URL_PASSWORD.search(text))


def mask_tokens(text: str) -> str:
    """``text`` with every credential-shaped part replaced by ``<redacted>``."""
    return URL_PASSWORD.sub(rf"\1:{REDACTED}@", TOKEN_SHAPES.sub(REDACTED, text))


class NotShown:
    """Stands for a value that may be a secret in an error message."""

    def __repr__(self) -> str:
        return REDACTED
