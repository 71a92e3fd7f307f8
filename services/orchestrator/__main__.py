"""`python -m m27.orchestrator --nats URL [--grpc HOST:PORT]`: the pipeline API."""

from m27.common.service import run_service, service_parser
from m27.orchestrator.service import serve


def main() -> None:
    parser = service_parser("orchestrator", "Serves m27.v1.PipelineService: turns pipeline "
                            "YAML into runs, keeps their state in JetStream KV and releases "
                            "each step once its dependencies succeeded.")
    run_service("orchestrator", parser.parse_args(), {}, serve)


if __name__ == "__main__":
    main()
