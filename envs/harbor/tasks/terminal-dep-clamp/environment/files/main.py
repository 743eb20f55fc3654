import sys
from mathutils import clamp

if __name__ == "__main__":
    print(clamp(int(sys.argv[1]), 0, 10))
