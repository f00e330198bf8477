from wwrun.cli import main

raise SystemExit(main())
