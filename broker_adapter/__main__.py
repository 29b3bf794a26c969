from broker_adapter.cli import main

raise SystemExit(main())
