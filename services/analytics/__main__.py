from gpuherd.runtime.shell import main
from services.analytics.spec import SPEC

main(SPEC)
