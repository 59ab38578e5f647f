"""`python -m draftsmith.hidden CONFIG.json`: one rank of stage 04 (see `draftsmith.hidden.stage`)."""

import sys

from .stage import main

sys.exit(main())
