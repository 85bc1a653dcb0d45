"""Start Serve (its controller and HTTP proxies) on a running Ray cluster with a Serve config's cluster-wide
settings, ``logging_config`` included; ``make serve`` runs it before ``serve run``.

``serve run CONFIG`` (Ray 2.60) starts the controller and proxies with Serve's default logging (INFO, every
deployment step and proxy event on the console) and hands the config's top-level ``logging_config`` only to the
applications. Started here first, the controller and proxies log at the config's level; ``serve run`` then
finds Serve running with the same HTTP options and deploys the applications into it.

    RAY_ADDRESS=127.0.0.1:6391 python scripts/serve_start.py deploy/dev.yaml

Exit codes: 0 started (or already running), 2 the config is not a valid Serve config.
"""

from __future__ import annotations

import argparse
import logging
import sys

import yaml


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="example:\n  RAY_ADDRESS=127.0.0.1:6391 python scripts/serve_start.py deploy/dev.yaml")
    parser.add_argument("config", help="Serve config file (ServeDeploySchema)")
    args = parser.parse_args(argv)

    from pydantic import ValidationError
    from ray.serve.schema import ServeDeploySchema

    try:
        with open(args.config) as handle:
            config = ServeDeploySchema.model_validate(yaml.safe_load(handle))
    except (OSError, yaml.YAMLError, ValidationError) as exc:
        print(f"error: {args.config}: not a Serve config ({str(exc).splitlines()[0]})", file=sys.stderr)
        return 2

    import ray
    from ray import serve

    ray.init(namespace="serve", logging_level=logging.WARNING, log_to_driver=False)
    logging.getLogger("ray.serve").setLevel(logging.WARNING)  # no "Started Serve" line: make serve says it
    try:
        serve.start(proxy_location=config.proxy_location, http_options=config.http_options.model_dump(),
                    logging_config=config.logging_config)
    finally:
        ray.shutdown()
    level = config.logging_config.log_level if config.logging_config else "INFO"
    print(f"Serve started: controller and proxies log at {level}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
