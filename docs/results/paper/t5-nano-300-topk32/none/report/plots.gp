set terminal pngcairo size 900,560 noenhanced
set grid
set key outside bottom center
set datafile missing 'NaN'
set output 'val_loss_vs_step.png'
set title 'Validation loss'
set xlabel 'step'
set ylabel 'loss'
unset logscale y
plot 'run0.dat' using 1:3 with linespoints title 'flexdemo (flexdemo, demo)', 'run1.dat' using 1:3 with linespoints title 'adamw-hsdp (adamw, full)', 'run2.dat' using 1:3 with linespoints title 'flexdemo-adamw (flexdemo-adamw, demo)'
set output 'val_loss_vs_time.png'
set title 'Validation loss against wall time'
set xlabel 'seconds'
set ylabel 'loss'
unset logscale y
plot 'run0.dat' using 2:3 with linespoints title 'flexdemo (flexdemo, demo)', 'run1.dat' using 2:3 with linespoints title 'adamw-hsdp (adamw, full)', 'run2.dat' using 2:3 with linespoints title 'flexdemo-adamw (flexdemo-adamw, demo)'
set output 'inter_bytes_per_step.png'
set title 'Bytes between nodes per step (all ranks)'
set xlabel 'step'
set ylabel 'bytes'
set logscale y
plot 'run0.dat' using 1:4 with lines title 'flexdemo (flexdemo, demo)', 'run1.dat' using 1:4 with lines title 'adamw-hsdp (adamw, full)', 'run2.dat' using 1:4 with lines title 'flexdemo-adamw (flexdemo-adamw, demo)'
set output 'step_time_split.png'
set title 'Mean step time per rank'
set xlabel ''
set ylabel 'ms'
unset logscale y
set style data histograms
set style histogram rowstacked
set style fill solid 0.8 border -1
set boxwidth 0.6
plot 'step_split.dat' using 2:xtic(1) title 'compute', '' using 3 title 'communication'
