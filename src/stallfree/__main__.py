"""`python -m stallfree` is the `stallfree` console script."""

from stallfree.cli import main

raise SystemExit(main())
