import glob
import os
import sys
import xml.etree.ElementTree as ET

d = sys.argv[1]
print(f"{'mode':8} {'file':26} {'tests':>6} {'pass':>6} {'fail':>5} {'error':>5} {'skip':>5}  time")
for x in sorted(glob.glob(os.path.join(d, "*.xml"))):
    mode, name = os.path.basename(x)[:-4].split(".", 1)
    try:
        s = ET.parse(x).getroot()
        s = s if s.tag == "testsuite" else s[0]
    except Exception as e:
        print(f"{mode:8} {name:26} no junit ({e}): timed out?")
        continue
    t, f, e, k = (int(s.get(a)) for a in ("tests", "failures", "errors", "skipped"))
    print(f"{mode:8} {name:26} {t:6} {t - f - e - k:6} {f:5} {e:5} {k:5}  {float(s.get('time')):.0f}s")
