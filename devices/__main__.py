import sys

from devices.device import main

sys.exit(main())
