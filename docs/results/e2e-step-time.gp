set terminal pngcairo size 900,560 noenhanced
set output 'bench/results/e2e-step-time.png'
set title 'Median step time against link rate (2 nodes x 2 ranks, gpt-micro)'
set ylabel 'ms'; set logscale y; set grid; set key outside bottom center
set datafile separator ','
plot '< grep ",flexdemo," bench/results/e2e.csv' using 4:xtic(1) with linespoints title 'flexdemo', '< grep ",flexdemo-adamw," bench/results/e2e.csv' using 4:xtic(1) with linespoints title 'flexdemo-adamw', '< grep ",demo-s1," bench/results/e2e.csv' using 4:xtic(1) with linespoints title 'demo-s1', '< grep ",adamw-hsdp," bench/results/e2e.csv' using 4:xtic(1) with linespoints title 'adamw-hsdp', '< grep ",flexdemo-3x," bench/results/e2e.csv' using 4:xtic(1) with linespoints title 'flexdemo-3x', '< grep ",flexdemo-overlap," bench/results/e2e.csv' using 4:xtic(1) with linespoints title 'flexdemo-overlap', '< grep ",flexdemo-noclip," bench/results/e2e.csv' using 4:xtic(1) with linespoints title 'flexdemo-noclip', '< grep ",flexdemo-backward," bench/results/e2e.csv' using 4:xtic(1) with linespoints title 'flexdemo-backward'
