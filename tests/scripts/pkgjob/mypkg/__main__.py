import sys

from mypkg.helper import VALUE

print(f"module main={__name__} package={__package__} value={VALUE} argv={sys.argv[1:]}")
