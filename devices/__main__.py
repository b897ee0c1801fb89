import sys

from flt.devices.device import main

sys.exit(main())
