#!/usr/bin/env python3
"""Write the secret env files docker-compose.yml reads, with fresh random values.

    python3 deploy/make_env.py            # writes deploy/airflow.env and deploy/postgres.env

Each ``NAME.env`` is ``NAME.env.example`` with its ``{placeholders}`` filled: the metadata
database password (the same in both files), the Fernet key that encrypts connections and
variables, the JWT secret every Airflow component signs and checks task tokens with, and
the api-server's session key. Refuses to overwrite an existing file (a new Fernet key could
not decrypt what the old one encrypted; rotate with `airflow rotate-fernet-key`). Needs only
the Python standard library; git ignores the written files.
"""

from __future__ import annotations

import argparse
import base64
import os
import secrets
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
FILES = ("airflow.env", "postgres.env")


def fresh_secrets() -> dict[str, str]:
    """New random values for every placeholder of the example files."""
    return {
        "postgres_password": secrets.token_urlsafe(24),  # URL-safe: it sits in a SQL URL
        "fernet_key": base64.urlsafe_b64encode(os.urandom(32)).decode(),  # Fernet's format
        "jwt_secret": secrets.token_urlsafe(32),
        "api_secret_key": secrets.token_urlsafe(32),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--dir", type=Path, default=HERE, help="where to write the files (default: deploy/)"
    )
    args = parser.parse_args(argv)
    targets = [args.dir / name for name in FILES]
    existing = [str(t) for t in targets if t.exists()]
    if existing:
        print(
            f"{', '.join(existing)} already exist(s); nothing written. Delete them first to "
            "start over with new secrets (a new Fernet key cannot read what the old one "
            "encrypted)",
            file=sys.stderr,
        )
        return 1
    values = fresh_secrets()
    args.dir.mkdir(parents=True, exist_ok=True)
    for name, target in zip(FILES, targets, strict=True):
        text = (HERE / f"{name}.example").read_text().format_map(values)
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(text)
        print(f"wrote {target} (mode 600)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
