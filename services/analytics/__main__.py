from services.analytics.service import main

main()
