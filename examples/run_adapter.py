"""README "Run the adapter from Python"."""

from pathlib import Path
from broker_adapter import Adapter, AdapterConfig

if __name__ == "__main__":  # required: worker processes are spawned and import this file
    config = AdapterConfig(redis_url="redis://localhost:6390/0", db_path=Path("adapter.db"),
                           handler="handlers:restart", keyring_path=Path("keyring.json"),
                           workers=2)
    raise SystemExit(Adapter(config).run_forever())  # SIGTERM/SIGINT: drain, then stop
