from broker_adapter.app.cli import main

raise SystemExit(main())
