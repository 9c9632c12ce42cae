from services.scheduler.service import main

main()
