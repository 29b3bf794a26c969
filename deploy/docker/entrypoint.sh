#!/bin/sh
# Runs `broker-adapter "$@"`. When BA_KEYRING names a file that does not exist yet, first
# makes one (mode 0600) for the principal "agent" with a random 43-character secret, so
# that the compose profile starts without a secret in the repository. Publish to it with
#   docker compose exec adapter broker-adapter publish --principal agent --id t-1 \
#       --payload '{"x": 1}'
set -eu
if [ -n "${BA_KEYRING:-}" ] && [ ! -f "$BA_KEYRING" ]; then
    umask 077
    python -c 'import json, secrets, sys
json.dump({"agent": {"agent-1": secrets.token_urlsafe(32)}}, open(sys.argv[1], "w"))' "$BA_KEYRING"
fi
exec broker-adapter "$@"
