import sys

from trellm_openai.server import main

sys.exit(main())
